//! The `/metrics` endpoint (`metrics_listen`): OpenMetrics text that
//! `promtool check metrics` accepts; byte counters equal to the bytes the
//! test moved, also as a real Prometheus server scraped them (Debian's
//! `prometheus`, started on loopback by the test); a series count that a
//! flood of refused peers does not grow; idle with no thread spinning.
//!
//! Without `promtool` or `prometheus` those parts print SKIP, unless
//! `ORBITE_PROMETHEUS_REQUIRED` is set (CI installs them).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use orbite_core::*;

/// One HTTP GET on loopback: the status line's code and the body.
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    get_as(addr, path, "*/*")
}

/// As [`get`], accepting `accept`.
fn get_as(addr: SocketAddr, path: &str, accept: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let code = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, body.to_owned())
}

/// The value of the sample `name{labels}` (labels as written).
fn sample(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name_and_labels)?.trim().split(' ').next()?.parse().ok())
}

/// Sample lines (not comments).
fn series(text: &str) -> usize {
    text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).count()
}

fn required(tool: &str) -> bool {
    let found = std::process::Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
    if !found {
        assert!(std::env::var_os("ORBITE_PROMETHEUS_REQUIRED").is_none(), "no {tool} (apt-get install prometheus)");
        println!("SKIP: no {tool} (apt-get install prometheus)");
    }
    found
}

/// Moves `len` bytes with one WRITE on the self connection.
fn write_local(e: &TransferEngine, len: u64) {
    let a = region(e, len as usize, Permission::LocalOnly);
    let b = region(e, len as usize, Permission::RemoteReadWrite);
    fill(&a.mem, 1);
    let (l, r) = ([Desc::new(a.id, 0, len)], [Desc::new(b.id, 0, len)]);
    let t = e.prepare(&TransferSpec::new(Op::Write, &l, &r, Target::Loopback)).unwrap();
    t.post().unwrap();
    assert!(wait_retired(&t).outcome.is_success());
    drop(t);
    e.deregister(a.id).unwrap();
    e.deregister(b.id).unwrap();
}

#[test]
fn metrics_count_what_moved_and_pass_promtool() {
    let e = engine(r#"{"metrics_listen": "127.0.0.1:0", "task_bytes": 65536}"#);
    let addr = e.metrics_address().expect("the engine serves metrics");
    let (code, before) = get(addr, "/metrics");
    assert_eq!(code, 200);
    let (_, om) = get_as(addr, "/metrics", "application/openmetrics-text; version=1.0.0");
    assert!(om.trim_end().ends_with("# EOF"), "OpenMetrics text, asked for, ends with # EOF");
    assert!(om.contains("# TYPE orbite_transferred_bytes counter"), "OpenMetrics counter families");
    assert!(before.contains("# TYPE orbite_transferred_bytes_total counter"), "text format 0.0.4 otherwise");
    let key = r#"orbite_transferred_bytes_total{route="loopback",op="write"}"#;
    assert_eq!(sample(&before, key), Some(0.0));
    write_local(&e, 1 << 20);
    write_local(&e, 3 << 16);
    let (_, after) = get(addr, "/metrics");
    assert_eq!(sample(&after, key), Some(((1 << 20) + (3 << 16)) as f64), "bytes moved");
    let done = r#"orbite_transfers_total{route="loopback",op="write",outcome="success"}"#;
    assert_eq!(sample(&after, done), Some(2.0));
    let tasks = r#"orbite_task_retirements_total{route="loopback",op="write",end="complete"}"#;
    assert_eq!(sample(&after, tasks), Some(16.0 + 3.0), "one per task of 64 KiB");
    assert_eq!(sample(&after, r#"orbite_task_duration_seconds_count{route="loopback"}"#), Some(19.0));
    assert_eq!(sample(&after, "orbite_admission_wait_seconds_count"), Some(2.0));
    assert_eq!(sample(&after, r#"orbite_resource_limit{resource="registrations"}"#), Some(65536.0));
    assert_eq!(sample(&after, r#"orbite_resource_used{resource="registrations"}"#), Some(0.0));
    assert_eq!(sample(&after, "orbite_executions_in_flight"), Some(0.0));
    assert_eq!(series(&before), series(&after), "the series are fixed");
    assert_eq!(get(addr, "/other").0, 404);
    if required("promtool") {
        let mut p = std::process::Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        p.stdin.take().unwrap().write_all(after.as_bytes()).unwrap();
        let out = p.wait_with_output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "promtool check metrics: {said}");
    }
    // Closed: the endpoint goes.
    e.close();
    assert!(TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err(), "the endpoint closed with the engine");
}

/// Peers that fail authentication, from many connections: counted, and
/// the series stay as they were.
#[test]
fn a_flood_of_refused_peers_does_not_grow_the_series() {
    let dir = std::env::temp_dir().join(format!("orbite-metrics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").unwrap();
    let cfg = format!(
        r#"{{"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0", "auth": {{"secret_file": "{}"}}}}"#,
        secret.display()
    );
    let e = engine(&cfg);
    let addr = e.metrics_address().unwrap();
    let (_, before) = get(addr, "/metrics");
    let target = e.endpoint().unwrap();
    // Peers with another secret, and connections that send garbage.
    let other = dir.join("other");
    std::fs::write(&other, "fedcba9876543210fedcba9876543210").unwrap();
    let intruder = engine(&format!(r#"{{"auth": {{"secret_file": "{}"}}}}"#, other.display()));
    const N: u64 = 40;
    for _ in 0..N {
        assert!(intruder.open_segment(&target, None, Duration::from_secs(5)).is_err());
        let mut s = TcpStream::connect(e.listen_addr().unwrap()).unwrap();
        let _ = s.write_all(&[0xee; 64]);
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = s.read(&mut [0u8; 256]);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = loop {
        let (_, text) = get(addr, "/metrics");
        if sample(&text, "orbite_connections{state=\"all\"}") == Some(0.0) || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // The intruders fail on the target's proof and leave (the target
    // counts proofs that fail; these never sent one).
    assert_eq!(intruder.stats().auth_failures, N, "the intruder counts each refusal");
    assert_eq!(series(&before), series(&after), "no series per peer");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A real Prometheus server scrapes the engine while transfers run; its
/// HTTP API then gives the byte counter the test expects.
#[test]
fn prometheus_scrapes_the_engine() {
    if !required("prometheus") {
        return;
    }
    let e = engine(r#"{"metrics_listen": "127.0.0.1:0"}"#);
    let addr = e.metrics_address().unwrap();
    let dir = std::env::temp_dir().join(format!("orbite-prometheus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: orbite\n    static_configs:\n      - targets: ['{addr}']\n"
        ),
    )
    .unwrap();
    let web = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut server = std::process::Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address={web}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _guard = Kill(std::mem::replace(&mut server, std::process::Command::new("true").spawn().unwrap()));
    // Transfers while it scrapes.
    let mut moved = 0u64;
    for i in 0..5 {
        write_local(&e, 1 << (16 + i));
        moved += 1 << (16 + i);
        std::thread::sleep(Duration::from_millis(200));
    }
    let query = "/api/v1/query?query=orbite_transferred_bytes_total%7Broute%3D%22loopback%22%2Cop%3D%22write%22%7D";
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = TcpStream::connect(web).ok().map(|_| get(web, query));
        if let Some((200, body)) = got {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let value = v["data"]["result"][0]["value"][1].as_str().and_then(|s| s.parse::<f64>().ok());
            if value == Some(moved as f64) {
                break;
            }
        }
        assert!(Instant::now() < deadline, "Prometheus never saw {moved} bytes");
        std::thread::sleep(Duration::from_millis(250));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A KV session service adds its sessions to its engine's `/metrics`
/// (as `orbite serve` does): sessions by state, idempotent retries,
/// expiries, draining.
#[test]
fn kv_sessions_join_the_engines_metrics() {
    use orbite_core::session::*;
    let e = engine(r#"{"metrics_listen": "127.0.0.1:0"}"#);
    let addr = e.metrics_address().unwrap();
    let clock = std::sync::Arc::new(ManualClock::default());
    let svc = std::sync::Arc::new(KvSessionService::new(e.clone(), KvConnectorInfo::default(), clock));
    let source: std::sync::Weak<dyn MetricsSource> = std::sync::Arc::downgrade(&svc) as _;
    e.add_metrics(source);
    let req = AllocateRequest {
        request_id: "req-1".into(),
        model: "m".into(),
        idempotency_key: "k1".into(),
        style: KvScheduleStyle::Unspecified,
        disposition: KvTransferDisposition::Required,
        lease_ms: Some(10_000),
        meta: KvTransferMeta { layout: "l".into(), block_bytes: 4096, blocks: 1 },
    };
    svc.allocate(&req).unwrap();
    svc.allocate(&req).unwrap(); // an identical retry
    let (_, text) = get(addr, "/metrics");
    assert_eq!(sample(&text, r#"orbite_kv_sessions{state="live"}"#), Some(1.0), "{text}");
    assert_eq!(sample(&text, "orbite_kv_idempotent_retries_total"), Some(1.0));
    assert_eq!(sample(&text, "orbite_kv_session_expiries_total"), Some(0.0));
    assert_eq!(sample(&text, "orbite_kv_draining"), Some(0.0));
    // Every metric the Grafana dashboard (docs/grafana) queries is one the
    // engine and its sessions export.
    let dashboard =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/grafana/orbite-dashboard.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    assert!(json["panels"].as_array().is_some_and(|p| !p.is_empty()));
    let mut checked = 0;
    for word in dashboard.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if let Some(name) = word.strip_prefix("orbite_") {
            let name = format!("orbite_{name}");
            assert!(
                text.lines().any(|l| !l.starts_with('#') && l.starts_with(&name)),
                "the dashboard queries {name}, which /metrics lacks"
            );
            checked += 1;
        }
    }
    assert!(checked > 10, "the dashboard's queries were read");
    svc.start_drain();
    let (_, text) = get(addr, "/metrics");
    assert_eq!(sample(&text, "orbite_kv_draining"), Some(1.0));
    // The service gone, its metrics go with it.
    drop(svc);
    let (_, text) = get(addr, "/metrics");
    assert!(sample(&text, "orbite_kv_draining").is_none());
}
