//! `orbite serve`: an engine and the KV session service over gRPC as a
//! standalone process (sidecars, demos, the conformance suite).
//!
//! The engine owns a KV pool (`kv_pool_bytes`, one remotely readable
//! registration) that producers name when they mark KV ready; the stats
//! call lists it. SIGTERM or SIGINT drains: no new sessions, live ones get
//! `drain_timeout_ms` to end, the rest are aborted and their work gets the
//! same bound again to retire; then the server and the engine stop.

use std::sync::Arc;
use std::time::Duration;

use orbite_core::endpoint::ALL_INTERFACES;
use orbite_core::session::grpc::{DEFAULT_MAX_MESSAGE_BYTES, KvGrpcService};
use orbite_core::session::{KvConnectorInfo, KvSessionService, SystemClock};
use orbite_core::{EngineConfig, MemoryRange, Permission, TransferEngine};

/// The `--config` document.
#[derive(Debug, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct ServeConfig {
    /// The engine's configuration (docs/configuration.md). Without
    /// `listen`, the engine listens on all interfaces, as the NIXL backend.
    engine: serde_json::Map<String, serde_json::Value>,
    /// What the service advertises and enforces (any field of
    /// `KvConnectorInfo`; the rest keep their defaults).
    sessions: KvConnectorInfo,
    /// The KV pool producers mark ready from.
    kv_pool_bytes: u64,
    /// The reaper runs at least this often.
    reaper_period_ms: u64,
    /// The drain bound at SIGTERM (twice: live sessions, then aborted work).
    drain_timeout_ms: u64,
    /// Largest request decoded.
    max_message_bytes: u64,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            engine: serde_json::Map::new(),
            sessions: KvConnectorInfo::default(),
            kv_pool_bytes: 64 << 20,
            reaper_period_ms: 5,
            drain_timeout_ms: 10_000,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES as u64,
        }
    }
}

pub struct ServeArgs {
    listen: String,
    config: ServeConfig,
}

impl ServeArgs {
    pub fn parse(args: &[String]) -> Result<Self, String> {
        let mut listen = None;
        let mut config = None;
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--listen" => listen = Some(it.next().ok_or("--listen needs host:port")?.clone()),
                "--config" => {
                    let v = it.next().ok_or("--config needs a JSON object or @file")?;
                    let text = match v.strip_prefix('@') {
                        Some(path) => std::fs::read_to_string(path).map_err(|e| format!("--config {v}: {e}"))?,
                        None => v.clone(),
                    };
                    config = Some(serde_json::from_str::<ServeConfig>(&text).map_err(|e| format!("--config: {e}"))?);
                }
                other => return Err(format!("serve: unknown option `{other}`")),
            }
        }
        let listen = listen.ok_or("serve needs --listen host:port (port 0 picks one)")?;
        let config = config.unwrap_or_default();
        config.sessions.validate().map_err(|e| format!("--config sessions: {e}"))?;
        if config.kv_pool_bytes == 0 {
            return Err("--config: kv_pool_bytes must be at least 1".into());
        }
        if config.max_message_bytes < 1024 || config.max_message_bytes > (64 << 20) {
            return Err("--config: max_message_bytes must be between 1024 and 67108864".into());
        }
        Ok(ServeArgs { listen, config })
    }
}

fn style_names(info: &KvConnectorInfo) -> String {
    let name = |s: &orbite_core::session::KvScheduleStyle| format!("{s:?}");
    info.supported_styles.iter().map(name).collect::<Vec<_>>().join(",")
}

pub fn run(args: ServeArgs) -> Result<(), String> {
    let c = args.config;
    let mut engine_json = c.engine.clone();
    engine_json.entry("listen").or_insert_with(|| ALL_INTERFACES.into());
    let engine_config = EngineConfig::from_json(&serde_json::Value::Object(engine_json).to_string())
        .map_err(|e| format!("--config engine: {e}"))?;
    let engine = TransferEngine::new(engine_config).map_err(|e| format!("engine: {e}"))?;
    let pool_len = usize::try_from(c.kv_pool_bytes).map_err(|_| "kv_pool_bytes is too large")?;
    let pool = engine.allocate_host_memory(pool_len).map_err(|e| format!("kv pool: {e}"))?;
    let ids = engine
        .register_memory_ranges(vec![
            MemoryRange::host(&pool, 0, pool_len, Permission::RemoteRead).map_err(|e| format!("kv pool: {e}"))?,
        ])
        .map_err(|e| format!("kv pool: {e}"))?;
    let region = orbite_core::Desc { registration: ids[0], offset: 0, len: c.kv_pool_bytes };
    let service = Arc::new(KvSessionService::new(engine.clone(), c.sessions.clone(), Arc::new(SystemClock::default())));
    let reaper = service.start_reaper(Duration::from_millis(c.reaper_period_ms.max(1))).map_err(|e| e.to_string())?;
    let grpc = KvGrpcService::new(service.clone())
        .with_kv_regions(vec![region])
        .with_max_message_bytes(c.max_message_bytes as usize);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("orbite-grpc")
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let drain_bound = Duration::from_millis(c.drain_timeout_ms);
    let result = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let info = service.info();
        println!(
            "orbite serve: OpenEngineKv listening on {addr} (incarnation {:016x}; styles {}, default {:?}; \
             default lease {} ms, max {} ms; max live sessions {}; kv pool {} bytes at registration {}; \
             engine {} epoch {:016x})",
            service.incarnation(),
            style_names(&info),
            info.default_style,
            info.default_lease_ms,
            info.max_lease_ms,
            info.max_live_sessions,
            c.kv_pool_bytes,
            region.registration.to_raw(),
            engine.endpoint().unwrap_or_else(|| "(no listener)".into()),
            engine.source_epoch(),
        );
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let mut serving = tokio::spawn(grpc.clone().serve(listener, async {
            let _ = stop_rx.await;
        }));
        let signal = async {
            use tokio::signal::unix::{SignalKind, signal};
            let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
            let mut int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
            tokio::select! {
                _ = term.recv() => Ok::<_, String>("SIGTERM"),
                _ = int.recv() => Ok("SIGINT"),
            }
        };
        let which = tokio::select! {
            s = signal => s?,
            r = &mut serving => {
                return match r {
                    Ok(Ok(())) => Err("the server stopped".to_owned()),
                    Ok(Err(e)) => Err(format!("the server failed: {e}")),
                    Err(e) => Err(format!("the server task failed: {e}")),
                };
            }
        };
        let live = service.live_count();
        let report = grpc.drain(drain_bound, true).await;
        let _ = stop_tx.send(());
        let _ = serving.await;
        println!(
            "orbite serve: {which}: drained {} live sessions within {} ms ({} aborted); left: live {}, pinned ranges {}, \
             tracked transfers {}, awaiting cleanup {}",
            live,
            c.drain_timeout_ms,
            report.aborted,
            report.stats.live_sessions,
            report.stats.pinned_ranges,
            report.stats.tracked_transfers,
            report.stats.awaiting_cleanup,
        );
        Ok::<bool, String>(report.drained)
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    reaper.stop();
    drop(service);
    let close = engine.close();
    let drained = result?;
    println!("orbite serve: stopped ({close:?})");
    if drained { Ok(()) } else { Err("the drain bound passed with work not retired".into()) }
}
