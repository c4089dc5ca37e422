//! The engine's metrics, in Prometheus/OpenMetrics text at `/metrics` on
//! `metrics_listen` (docs/observability.md).
//!
//! The data path only adds to atomics ([`Metrics`]: per route and
//! direction, bytes, transfers by outcome, task ends, a task duration
//! histogram; the admission wait): no lock, no allocation. Everything else
//! (budgets and their limits, peers, connections, notifications, staging)
//! is read at scrape time from what the engine already counts. Labels come
//! from fixed sets (routes, directions, outcomes, task ends, resources):
//! no peer address or id is ever a label, so no peer can grow the series.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::batch::{Op, OutcomeCode};
use crate::engine::EngineInner;
use crate::types::{Route, TaskEnd};

/// Every route, in label order.
const ROUTES: [Route; Route::all().len()] = Route::all();
/// Every direction and every outcome, in label order, with their labels.
const OPS: [(Op, &str); 2] = [(Op::Read, "read"), (Op::Write, "write")];
const OUTCOMES: [(OutcomeCode, &str); 6] = [
    (OutcomeCode::Success, "success"),
    (OutcomeCode::Cancelled, "cancelled"),
    (OutcomeCode::TimedOut, "timed_out"),
    (OutcomeCode::ShortCompletion, "short"),
    (OutcomeCode::Failed, "failed"),
    (OutcomeCode::NotificationFailed, "notification_failed"),
];
const ENDS: [&str; 3] = ["complete", "short", "failed"];
/// Histogram bucket bounds, in seconds (then +Inf).
const BOUNDS: [f64; 18] = [
    0.000_01, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

fn route_index(r: Route) -> usize {
    ROUTES.iter().position(|x| *x == r).unwrap_or(0)
}

fn op_index(op: Op) -> usize {
    OPS.iter().position(|(x, _)| *x == op).unwrap_or(0)
}

/// A histogram of durations, in atomics.
#[derive(Default)]
struct Histogram {
    buckets: [AtomicU64; BOUNDS.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let at = BOUNDS.iter().position(|b| s <= *b).unwrap_or(BOUNDS.len());
        self.buckets[at].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// `(sum in seconds, count, per-bucket counts with their bounds)`.
    fn read(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        let buckets = BOUNDS.iter().copied().chain([f64::INFINITY]).zip(counts.iter().copied()).collect();
        (self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9, counts.iter().sum(), buckets)
    }
}

/// What the data path counts.
#[derive(Default)]
pub(crate) struct Metrics {
    /// Bytes moved, by route and direction.
    bytes: [[AtomicU64; 2]; ROUTES.len()],
    /// Executions retired, by route, direction and logical outcome.
    transfers: [[[AtomicU64; OUTCOMES.len()]; 2]; ROUTES.len()],
    /// Route tasks retired, by route, direction and how they ended.
    tasks: [[[AtomicU64; ENDS.len()]; 2]; ROUTES.len()],
    /// Task durations (admission to end), by route.
    task_seconds: [Histogram; ROUTES.len()],
    /// Time from post to the first task's admission.
    admission_wait: Histogram,
    /// Notifications a peer sent that this engine refused.
    pub notifications_refused: AtomicU64,
}

impl Metrics {
    /// A route task ended: `done` bytes, how, and after `took`.
    pub fn task_ended(&self, route: Route, op: Op, done: u64, end: TaskEnd, took: Duration) {
        let (r, o) = (route_index(route), op_index(op));
        self.bytes[r][o].fetch_add(done, Ordering::Relaxed);
        let e = match end {
            TaskEnd::Complete => 0,
            TaskEnd::Short => 1,
            TaskEnd::Failed { .. } => 2,
        };
        self.tasks[r][o][e].fetch_add(1, Ordering::Relaxed);
        self.task_seconds[r].observe(took);
    }

    /// An execution retired with `outcome`.
    pub fn transfer_retired(&self, route: Route, op: Op, outcome: OutcomeCode) {
        let i = OUTCOMES.iter().position(|(x, _)| *x == outcome).unwrap_or(0);
        self.transfers[route_index(route)][op_index(op)][i].fetch_add(1, Ordering::Relaxed);
    }

    /// An execution's first task was admitted `waited` after its post.
    pub fn admitted_after(&self, waited: Duration) {
        self.admission_wait.observe(waited);
    }
}

/// One metric family a layer above the engine adds to its `/metrics`
/// (the KV session service does): its name, help, whether it is a counter
/// (else a gauge), and its samples, each with its labels (from fixed sets:
/// never a peer's address or id) and value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricFamily {
    /// The family's name (a counter's without `_total`).
    pub name: &'static str,
    /// One line of help.
    pub help: &'static str,
    /// A counter (else a gauge).
    pub counter: bool,
    /// Each sample's labels and value.
    pub samples: Vec<(Vec<(&'static str, &'static str)>, u64)>,
}

/// What a layer above the engine exports through the engine's `/metrics`
/// ([`crate::TransferEngine::add_metrics`]), read at each scrape.
pub trait MetricsSource: Send + Sync {
    /// Its families now.
    fn families(&self) -> Vec<MetricFamily>;
}

/// The engine as a Prometheus collector (weakly: a scrape after close
/// finds nothing).
#[derive(Debug)]
pub(crate) struct EngineCollector(pub Weak<EngineInner>);

type Fmt = Result<(), std::fmt::Error>;

/// One family: counters (else gauges), each sample with its labels.
fn family<L>(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    counter: bool,
    samples: impl IntoIterator<Item = (L, u64)>,
) -> Fmt
where
    L: EncodeLabelSet + AsRef<[(&'static str, &'static str)]>,
{
    let kind = if counter { MetricType::Counter } else { MetricType::Gauge };
    let mut d = e.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in samples {
        // A sample without labels is the family's only one.
        match (labels.as_ref().is_empty(), counter) {
            (true, true) => d.encode_counter::<NoLabelSet, _, u64>(&v, None)?,
            (true, false) => d.encode_gauge(&(v as i64))?,
            (false, true) => d.encode_family(&labels)?.encode_counter::<NoLabelSet, _, u64>(&v, None)?,
            (false, false) => d.encode_family(&labels)?.encode_gauge(&(v as i64))?,
        }
    }
    Ok(())
}

fn gauge(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> Fmt {
    family(e, name, help, false, [([], v)])
}

fn counter(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> Fmt {
    family(e, name, help, true, [([], v)])
}

impl Collector for EngineCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Fmt {
        let Some(engine) = self.0.upgrade() else { return Ok(()) };
        engine.encode_metrics(&mut e)?;
        let sources: Vec<Arc<dyn MetricsSource>> =
            engine.metrics_sources.lock().iter().filter_map(Weak::upgrade).collect();
        for f in sources.iter().flat_map(|s| s.families()) {
            family(&mut e, f.name, f.help, f.counter, f.samples)?;
        }
        Ok(())
    }
}

impl EngineInner {
    fn encode_metrics(&self, e: &mut DescriptorEncoder<'_>) -> Fmt {
        let m = &self.metrics;
        let s = self.counters.snapshot();
        let c = &self.config;
        // Per route and direction (indices and labels).
        let by_route_op = || {
            ROUTES
                .iter()
                .enumerate()
                .flat_map(|(ri, r)| OPS.iter().enumerate().map(move |(oi, (_, op))| (ri, oi, r.name(), *op)))
        };
        let bytes =
            by_route_op().map(|(ri, oi, r, op)| ([("route", r), ("op", op)], m.bytes[ri][oi].load(Ordering::Relaxed)));
        family(
            e,
            "orbite_transferred_bytes",
            "Bytes moved by route tasks (what each task reported landed)",
            true,
            bytes,
        )?;
        let transfers = by_route_op().flat_map(|(ri, oi, r, op)| {
            OUTCOMES.iter().enumerate().map(move |(ci, (_, o))| {
                ([("route", r), ("op", op), ("outcome", *o)], m.transfers[ri][oi][ci].load(Ordering::Relaxed))
            })
        });
        family(e, "orbite_transfers", "Executions retired, by their logical outcome", true, transfers)?;
        let tasks = by_route_op().flat_map(|(ri, oi, r, op)| {
            ENDS.iter().enumerate().map(move |(ei, end)| {
                ([("route", r), ("op", op), ("end", *end)], m.tasks[ri][oi][ei].load(Ordering::Relaxed))
            })
        });
        family(e, "orbite_task_retirements", "Route tasks physically retired, by how they ended", true, tasks)?;
        {
            let mut d = e.encode_descriptor(
                "orbite_task_duration_seconds",
                "Route task durations, from admission to the task's end",
                None,
                MetricType::Histogram,
            )?;
            for (ri, r) in ROUTES.iter().enumerate() {
                let (sum, count, buckets) = m.task_seconds[ri].read();
                let labels = [("route", r.name())];
                d.encode_family(&labels)?.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
            }
        }
        {
            let (sum, count, buckets) = m.admission_wait.read();
            let mut d = e.encode_descriptor(
                "orbite_admission_wait_seconds",
                "Time from post to the admission of an execution's first task",
                None,
                MetricType::Histogram,
            )?;
            d.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        }
        gauge(e, "orbite_executions_in_flight", "Posted executions not yet retired", s.executions)?;
        gauge(e, "orbite_admission_queue_depth", "Executions waiting for admission", s.queued_executions)?;
        // Every budget: what it holds and its limit.
        let queued = self.notifications.queue.lock().len() as u64;
        let budgets: [(&str, u64, u64); 17] = [
            ("registrations", s.registrations, c.max_registrations),
            ("registered_bytes", s.registered_bytes, c.max_registered_bytes),
            ("host_memory_bytes", s.host_memory_bytes, c.max_host_memory_bytes),
            ("prepared_transfers", s.prepared_transfers, c.max_prepared_transfers),
            ("executions", s.executions, c.max_executions),
            ("admission_queue", s.queued_executions, c.admission_queue_len),
            ("bytes_in_flight", s.bytes_in_flight, c.max_bytes_in_flight),
            ("tasks_in_flight", s.tasks_in_flight, c.max_tasks_in_flight),
            ("notification_bytes", s.notification_bytes, c.notification_queue_bytes),
            ("notification_queue", queued, c.notification_queue_len),
            ("binding_handles", s.binding_handles, c.max_binding_handles),
            ("staging_bytes", s.staging_bytes, c.max_staging_bytes),
            ("frame_buffer_bytes", s.frame_buffer_bytes, c.max_frame_buffer_bytes),
            ("borrows", s.borrows, c.max_borrows),
            ("borrow_bytes", s.borrow_bytes, c.max_borrow_bytes),
            ("connections", s.connections, c.max_connections),
            ("watchers", s.watchers, c.max_watchers),
        ];
        let used = budgets.map(|(resource, used, _)| ([("resource", resource)], used));
        family(e, "orbite_resource_used", "What each budgeted resource holds now", false, used)?;
        let limits = budgets.map(|(resource, _, max)| ([("resource", resource)], max));
        family(e, "orbite_resource_limit", "Each budgeted resource's limit", false, limits)?;
        // Peers this engine opened, alive and lost.
        let (open, lost) = {
            let all = self.peers.all.lock();
            let live: Vec<Arc<crate::engine::transfer::Peer>> = all.iter().filter_map(Weak::upgrade).collect();
            let lost = live.iter().filter(|p| p.link.is_lost()).count() as u64;
            (live.len() as u64 - lost, lost)
        };
        family(
            e,
            "orbite_peers",
            "Peers this engine opened",
            false,
            [([("state", "open")], open), ([("state", "lost")], lost)],
        )?;
        let unauthenticated = self.listener.server.lock().as_ref().map_or(0, |s| s.unauthenticated()) as u64;
        let connections = [([("state", "all")], s.connections), ([("state", "unauthenticated")], unauthenticated)];
        family(e, "orbite_connections", "Peer connections the listener holds", false, connections)?;
        counter(e, "orbite_connections_refused", "Connections closed at accept for a full cap", s.connections_refused)?;
        counter(e, "orbite_auth_failures", "Peer connections that failed authentication, either way", s.auth_failures)?;
        gauge(e, "orbite_notifications_queued", "Received notifications not yet taken", queued)?;
        counter(
            e,
            "orbite_notifications_refused",
            "Notifications from peers this engine refused (queue full, too large, wrong epoch)",
            m.notifications_refused.load(Ordering::Relaxed),
        )?;
        gauge(e, "orbite_staging_buffers", "Page-locked staging buffers alive", s.staging_buffers)?;
        gauge(
            e,
            "orbite_registrations_fenced",
            "Deregistered registrations a borrower still holds",
            s.fenced_registrations,
        )?;
        Ok(())
    }
}

/// The `/metrics` endpoint: a thread that answers each connection's one
/// request (GET `/metrics`: the engine's metrics in OpenMetrics text;
/// anything else: 404), asleep in `poll` between them, until stopped.
pub(crate) struct MetricsServer {
    pub addr: std::net::SocketAddr,
    wake: std::os::fd::OwnedFd,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Longest request head read, and how long a client may take to send it
/// or read the answer.
const MAX_REQUEST: usize = 8192;
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

impl MetricsServer {
    /// Serves `engine`'s metrics on `bind` (`host:port`).
    pub fn start(bind: &str, engine: Weak<EngineInner>) -> std::io::Result<MetricsServer> {
        use std::os::fd::{AsRawFd, FromRawFd};
        let listener = std::net::TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        // SAFETY: plain eventfd creation.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor this value owns.
        let wake = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let wake_fd = wake.as_raw_fd();
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(EngineCollector(engine)));
        let thread = std::thread::Builder::new().name("orbite-metrics".into()).spawn(move || {
            loop {
                let mut fds = [
                    libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                    libc::pollfd { fd: wake_fd, events: libc::POLLIN, revents: 0 },
                ];
                // SAFETY: two pollfds of live descriptors (the wake fd
                // outlives the thread: stop joins it before dropping it).
                let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
                if r < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                    return;
                }
                if fds[1].revents != 0 {
                    return;
                }
                if fds[0].revents != 0 {
                    if let Ok((stream, _)) = listener.accept() {
                        answer(stream, &registry);
                    }
                }
            }
        })?;
        Ok(MetricsServer { addr, wake, thread: Some(thread) })
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        let one = 1u64;
        // SAFETY: 8 bytes into this server's eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// OpenMetrics text as the Prometheus text format 0.0.4: a counter
/// family's HELP and TYPE name its samples' name (with `_total`), and the
/// `# EOF` marker goes.
fn prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].iter().find_map(|p| Some((*p, line.strip_prefix(p)?)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let total = if counters.contains(name) { "_total" } else { "" };
                out.push_str(&format!("{prefix}{name}{total} {tail}"));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Answers one connection's request.
fn answer(mut stream: std::net::TcpStream, registry: &prometheus_client::registry::Registry) {
    use std::io::{Read, Write};
    let _ = stream.set_read_timeout(Some(CLIENT_TIMEOUT));
    let _ = stream.set_write_timeout(Some(CLIENT_TIMEOUT));
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&head);
    // OpenMetrics for a client that asks for it (Prometheus does);
    // otherwise the Prometheus text format 0.0.4, which every scraper and
    // `promtool check metrics` read.
    let openmetrics = text.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("accept:") && l.contains("application/openmetrics-text")
    });
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let mut words = line.split(|b| *b == b' ');
    let (method, path) = (words.next().unwrap_or_default(), words.next().unwrap_or_default());
    let path = path.split(|b| *b == b'?').next().unwrap_or_default();
    let (status, kind, body) = if method == b"GET" && path == b"/metrics" {
        let mut text = String::new();
        match prometheus_client::encoding::text::encode(&mut text, registry) {
            Ok(()) if openmetrics => ("200 OK", "application/openmetrics-text; version=1.0.0; charset=utf-8", text),
            Ok(()) => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", prometheus_text(&text)),
            Err(_) => ("500 Internal Server Error", "text/plain", "encoding failed\n".to_owned()),
        }
    } else {
        ("404 Not Found", "text/plain", "only GET /metrics\n".to_owned())
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(reply.as_bytes());
}
