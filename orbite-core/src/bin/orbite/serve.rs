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
use orbite_core::session::{KvConnectorInfo, KvError, KvSessionService, SystemClock};
use orbite_core::{ConfigError, EngineConfig, MemoryError, MemoryRange, Permission, TransferEngine};

use crate::error::{ValueError, config_document};

/// The `--config` document.
#[derive(Debug, Clone, serde::Deserialize)]
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

/// `orbite serve`'s flags.
#[derive(Debug, clap::Args)]
#[command(args_override_self = true)]
pub struct ServeArgs {
    /// Where the gRPC service listens, HOST:PORT (port 0 picks one)
    #[arg(long, value_name = "HOST:PORT")]
    listen: String,
    /// The service's configuration, a JSON object or @FILE: {"engine": {..},
    /// "sessions": {..}, "kv_pool_bytes", "reaper_period_ms",
    /// "drain_timeout_ms", "max_message_bytes"} (docs/api.md)
    #[arg(long, value_name = "JSON|@FILE", value_parser = ServeConfig::parse)]
    config: Option<ServeConfig>,
}

/// Why `--config` was refused.
#[derive(Debug, thiserror::Error)]
pub enum ServeConfigError {
    /// The document could not be read.
    #[error(transparent)]
    Document(#[from] ValueError),
    /// Not JSON, or not the fields of a [`ServeConfig`].
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// `sessions` holds limits the service refuses.
    #[error("sessions: {0}")]
    Sessions(orbite_core::session::ConnectorInfoError),
    /// `kv_pool_bytes` is 0.
    #[error("kv_pool_bytes must be at least 1")]
    EmptyKvPool,
    /// `max_message_bytes` out of bounds.
    #[error("max_message_bytes must be between 1024 and 67108864")]
    MaxMessageBytes,
}

impl ServeConfig {
    /// The value of `--config`, checked.
    fn parse(value: &str) -> Result<Self, ServeConfigError> {
        let config = serde_json::from_str::<ServeConfig>(&config_document(value)?)?;
        config.sessions.validate().map_err(ServeConfigError::Sessions)?;
        if config.kv_pool_bytes == 0 {
            return Err(ServeConfigError::EmptyKvPool);
        }
        if config.max_message_bytes < 1024 || config.max_message_bytes > (64 << 20) {
            return Err(ServeConfigError::MaxMessageBytes);
        }
        Ok(config)
    }
}

fn style_names(info: &KvConnectorInfo) -> String {
    let name = |s: &orbite_core::session::KvScheduleStyle| format!("{s:?}");
    info.supported_styles.iter().map(name).collect::<Vec<_>>().join(",")
}

/// Why `orbite serve` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// `--config`'s `engine` object is not a valid engine configuration.
    #[error("--config engine: {0}")]
    EngineConfig(#[source] ConfigError),
    /// The engine could not be made.
    #[error("engine: {0}")]
    Engine(#[source] orbite_core::Error),
    /// `kv_pool_bytes` does not fit this host's address space.
    #[error("kv_pool_bytes is too large")]
    KvPoolTooLarge,
    /// The KV pool could not be allocated or registered.
    #[error("kv pool: {0}")]
    KvPool(#[source] orbite_core::Error),
    /// The KV pool's range could not be described.
    #[error("kv pool: {0}")]
    KvPoolRange(#[source] MemoryError),
    /// The reaper thread could not be started.
    #[error("cannot start the reaper: {0}")]
    Reaper(#[source] KvError),
    /// The async runtime could not be started.
    #[error("cannot start the runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// `--listen` could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// `--listen`.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The listener's address could not be read.
    #[error("cannot read the listener's address: {0}")]
    ListenAddr(#[source] std::io::Error),
    /// SIGTERM and SIGINT could not be watched for.
    #[error("cannot watch for signals: {0}")]
    Signals(#[source] std::io::Error),
    /// The gRPC server stopped with no signal.
    #[error("the server stopped")]
    Stopped,
    /// The gRPC server failed.
    #[error("the server failed: {0}")]
    Failed(#[source] tonic::transport::Error),
    /// The gRPC server's task panicked or was cancelled.
    #[error("the server task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// The drain bound passed with sessions' work not retired.
    #[error("the drain bound passed with work not retired")]
    NotDrained,
}

pub fn run(args: ServeArgs) -> Result<(), ServeError> {
    let c = args.config.unwrap_or_default();
    let mut engine_json = c.engine.clone();
    engine_json.entry("listen").or_insert_with(|| ALL_INTERFACES.into());
    let engine_config = EngineConfig::from_json(&serde_json::Value::Object(engine_json).to_string())
        .map_err(ServeError::EngineConfig)?;
    let engine = TransferEngine::new(engine_config).map_err(ServeError::Engine)?;
    let pool_len = usize::try_from(c.kv_pool_bytes).map_err(|_| ServeError::KvPoolTooLarge)?;
    let pool = engine.allocate_host_memory(pool_len).map_err(ServeError::KvPool)?;
    let ids = engine
        .register_memory_ranges(vec![
            MemoryRange::host(&pool, 0, pool_len, Permission::RemoteRead).map_err(ServeError::KvPoolRange)?,
        ])
        .map_err(ServeError::KvPool)?;
    let region = orbite_core::Desc { registration: ids[0], offset: 0, len: c.kv_pool_bytes };
    let service = Arc::new(KvSessionService::new(engine.clone(), c.sessions.clone(), Arc::new(SystemClock::default())));
    // The sessions' metrics join the engine's `/metrics` (metrics_listen).
    let source: std::sync::Weak<dyn orbite_core::MetricsSource> = Arc::downgrade(&service) as _;
    engine.add_metrics(source);
    let reaper = service.start_reaper(Duration::from_millis(c.reaper_period_ms.max(1))).map_err(ServeError::Reaper)?;
    let grpc = KvGrpcService::new(service.clone())
        .with_kv_regions(vec![region])
        .with_max_message_bytes(c.max_message_bytes as usize);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("orbite-grpc")
        .build()
        .map_err(ServeError::Runtime)?;
    let drain_bound = Duration::from_millis(c.drain_timeout_ms);
    let result = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .map_err(|source| ServeError::Listen { addr: args.listen.clone(), source })?;
        let addr = listener.local_addr().map_err(ServeError::ListenAddr)?;
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
            let mut term = signal(SignalKind::terminate()).map_err(ServeError::Signals)?;
            let mut int = signal(SignalKind::interrupt()).map_err(ServeError::Signals)?;
            tokio::select! {
                _ = term.recv() => Ok::<_, ServeError>("SIGTERM"),
                _ = int.recv() => Ok("SIGINT"),
            }
        };
        let which = tokio::select! {
            s = signal => s?,
            r = &mut serving => {
                return match r {
                    Ok(Ok(())) => Err(ServeError::Stopped),
                    Ok(Err(e)) => Err(ServeError::Failed(e)),
                    Err(e) => Err(ServeError::Task(e)),
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
        Ok::<bool, ServeError>(report.drained)
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    reaper.stop();
    drop(service);
    let close = engine.close();
    let drained = result?;
    println!("orbite serve: stopped ({close:?})");
    if drained { Ok(()) } else { Err(ServeError::NotDrained) }
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;

    use super::ServeArgs;
    use crate::{Command, parse};

    fn serve(args: &[&str]) -> ServeArgs {
        match parse(&[&["serve"], args].concat()) {
            Ok(Command::Serve(a)) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn listen_is_required_and_config_is_checked() {
        let a = serve(&["--listen", "127.0.0.1:0"]);
        assert_eq!(a.listen, "127.0.0.1:0");
        assert!(a.config.is_none());
        let a = serve(&["--config", r#"{"kv_pool_bytes": 4096, "engine": {"route": "tcp"}}"#, "--listen", "[::1]:0"]);
        let c = a.config.unwrap();
        assert_eq!((a.listen.as_str(), c.kv_pool_bytes, c.engine["route"].as_str()), ("[::1]:0", 4096, Some("tcp")));
        assert_eq!(parse(&["serve"]).unwrap_err().kind(), ErrorKind::MissingRequiredArgument);
        for (config, why) in [
            (r#"{"kv_pool_bytes": 0}"#, "kv_pool_bytes must be at least 1"),
            (r#"{"max_message_bytes": 100}"#, "max_message_bytes must be between"),
            (r#"{"kv_pool": 1}"#, "unknown field `kv_pool`"),
            (r#"{"sessions": {"max_live_sessions": 0}}"#, "sessions: "),
            ("@/nonexistent/serve.json", "cannot read /nonexistent/serve.json"),
        ] {
            let e = parse(&["serve", "--listen", "127.0.0.1:0", "--config", config]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{config}: {e}");
            assert!(e.to_string().contains("--config") && e.to_string().contains(why), "{config}: {e}");
        }
    }
}
