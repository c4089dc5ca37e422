//! `orbite bench --workload rpc` (feature `grpc`): the KV session service
//! over gRPC on loopback, against a trivial echo RPC on the same server
//! stack (tonic, HTTP/2, one runtime) as the reference.
//!
//! - G1: one client, one call at a time: p50 of a whole session life
//!   (allocate, mark ready with 16 KiB pinned, attach, complete, release:
//!   five RPCs) against the p50 of one echo RPC (16-byte payload).
//! - G2: 16 clients, each on its own connection, for a fixed time: session
//!   RPCs per second (whole lives) against echo RPCs per second.

use std::sync::Arc;
use std::time::{Duration, Instant};

use orbite_core::session::grpc::KvGrpcService;
use orbite_core::session::grpc::proto::open_engine_kv_client::OpenEngineKvClient;
use orbite_core::session::grpc::proto::orbite_diagnostics_client::OrbiteDiagnosticsClient;
use orbite_core::session::grpc::proto::{
    AllocateKvSessionRequest, AttachKvSessionRequest, CompleteKvSessionRequest, EchoRequest, KvRange, KvScheduleStyle,
    KvTransferMeta, MarkKvSessionReadyRequest, ReleaseKvSessionRequest,
};
use orbite_core::session::{KvConnectorInfo, KvSessionService, SystemClock};
use orbite_core::{Desc, EngineConfig, MemoryRange, Permission, TransferEngine};
use serde_json::{Value, json};
use tonic::transport::{Channel, Endpoint};

use crate::bench::round;
use crate::error::{Doing, Error};
use crate::measure::percentiles_us;

const KV: u64 = 16384;

fn meta() -> KvTransferMeta {
    KvTransferMeta { layout: "bench:16x128:bf16".into(), block_bytes: 4096, blocks: 4 }
}

struct Server {
    addr: std::net::SocketAddr,
    registration: u64,
    service: Arc<KvSessionService>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _engine: TransferEngine,
    _pool: orbite_core::HostMemory,
}

fn start(server_rt: &tokio::runtime::Runtime) -> Result<Server, Error> {
    let engine = TransferEngine::new(EngineConfig::default())?;
    let pool = engine.allocate_host_memory(1 << 20)?;
    let id = engine.register_memory_ranges(vec![MemoryRange::host(&pool, 0, 1 << 20, Permission::RemoteRead)?])?[0];
    let info = KvConnectorInfo { max_tombstones: 4096, ..KvConnectorInfo::default() };
    let service = Arc::new(KvSessionService::new(engine.clone(), info, Arc::new(SystemClock::default())));
    let grpc = KvGrpcService::new(service.clone()).with_kv_regions(vec![Desc::new(id, 0, 1 << 20)]);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let listener = server_rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).doing("listen on loopback")?;
    let addr = listener.local_addr().doing("read the loopback listener's address")?;
    server_rt.spawn(grpc.serve(listener, async {
        let _ = rx.await;
    }));
    Ok(Server { addr, registration: id.to_raw(), service, stop: Some(tx), _engine: engine, _pool: pool })
}

async fn channel(addr: std::net::SocketAddr) -> Result<Channel, Error> {
    let connect = |source| Error::Connect { addr, source };
    Endpoint::try_from(format!("http://{addr}")).map_err(connect)?.tcp_nodelay(true).connect().await.map_err(connect)
}

/// One whole session life; returns whether it was attached.
async fn life(kv: &mut OpenEngineKvClient<Channel>, registration: u64, key: &str) -> Result<bool, Error> {
    let s = kv
        .allocate_kv_session(AllocateKvSessionRequest {
            request_id: key.to_owned(),
            model: "bench-model".into(),
            idempotency_key: key.to_owned(),
            style: KvScheduleStyle::ContextFirst as i32,
            disposition: 0,
            lease_ms: None,
            meta: Some(meta()),
        })
        .await?
        .into_inner();
    let id = s.session_id;
    kv.mark_kv_session_ready(MarkKvSessionReadyRequest {
        session_id: id.clone(),
        ranges: vec![KvRange { registration, offset: 0, len: KV }],
        meta: Some(meta()),
    })
    .await?;
    let a =
        kv.attach_kv_session(AttachKvSessionRequest { session_id: id.clone(), meta: Some(meta()) }).await?.into_inner();
    kv.complete_kv_session(CompleteKvSessionRequest { session_id: id.clone() }).await?;
    kv.release_kv_session(ReleaseKvSessionRequest { session_id: id }).await?;
    Ok(!a.queued)
}

async fn echo(d: &mut OrbiteDiagnosticsClient<Channel>) -> Result<(), Error> {
    d.echo(EchoRequest { payload: vec![7; 16] }).await?;
    Ok(())
}

pub fn run(quick: bool) -> Result<Vec<Value>, Error> {
    let runtime = |name: &str, doing: &'static str| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name(name)
            .build()
            .doing(doing)
    };
    let server_rt = runtime("bench-grpc-server", "start the server runtime")?;
    let client_rt = runtime("bench-grpc-client", "start the client runtime")?;
    let mut server = start(&server_rt)?;
    let (addr, registration) = (server.addr, server.registration);
    let (n_echo, n_life) = if quick { (2_000, 400) } else { (20_000, 4_000) };
    let secs = if quick { 0.5 } else { 3.0 };
    let clients = 16;

    // G1: one at a time, echo and lives interleaved in rounds so that both
    // see the same machine.
    let (echo_us, life_us, attached) = client_rt.block_on(async {
        let ch = channel(addr).await?;
        let mut kv = OpenEngineKvClient::new(ch.clone());
        let mut d = OrbiteDiagnosticsClient::new(ch);
        for i in 0..200 {
            echo(&mut d).await?;
            life(&mut kv, registration, &format!("warm-{i}")).await?;
        }
        let (mut e, mut l) = (Vec::with_capacity(n_echo), Vec::with_capacity(n_life));
        let mut ok = true;
        let per_round = n_echo / n_life;
        for i in 0..n_life {
            for _ in 0..per_round {
                let t = Instant::now();
                echo(&mut d).await?;
                e.push(t.elapsed().as_secs_f64());
            }
            let t = Instant::now();
            ok &= life(&mut kv, registration, &format!("g1-{i}")).await?;
            l.push(t.elapsed().as_secs_f64());
        }
        Ok::<_, Error>((percentiles_us(&mut e), percentiles_us(&mut l), ok))
    })?;

    // G2: 16 clients, each its own connection, for `secs` each way.
    let throughput = |sessions: bool| -> Result<(f64, bool), Error> {
        client_rt.block_on(async {
            let deadline = Instant::now() + Duration::from_secs_f64(secs);
            let mut tasks = Vec::new();
            for c in 0..clients {
                let ch = channel(addr).await?;
                tasks.push(tokio::spawn(async move {
                    let mut kv = OpenEngineKvClient::new(ch.clone());
                    let mut d = OrbiteDiagnosticsClient::new(ch);
                    let (mut rpcs, mut ok, mut i) = (0u64, true, 0u64);
                    while Instant::now() < deadline {
                        if sessions {
                            ok &= life(&mut kv, registration, &format!("g2-{c}-{i}")).await?;
                            rpcs += 5;
                        } else {
                            echo(&mut d).await?;
                            rpcs += 1;
                        }
                        i += 1;
                    }
                    Ok::<_, Error>((rpcs, ok))
                }));
            }
            let start = Instant::now();
            let (mut total, mut ok) = (0u64, true);
            for t in tasks {
                let (n, o) = t.await??;
                total += n;
                ok &= o;
            }
            Ok((total as f64 / start.elapsed().as_secs_f64(), ok))
        })
    };
    let (echo_rps, _) = throughput(false)?;
    let (session_rps, ok2) = throughput(true)?;
    let (echo_rps2, _) = throughput(false)?;
    let echo_rps = (echo_rps + echo_rps2) / 2.0;

    server.service.poll();
    let st = server.service.stats();
    let clean = st.live_sessions == 0 && st.pinned_ranges == 0 && st.tracked_transfers == 0;
    if let Some(tx) = server.stop.take() {
        let _ = tx.send(());
    }
    drop(client_rt);
    server_rt.shutdown_timeout(Duration::from_secs(1));

    let g1 = life_us.0 / echo_us.0;
    let g2 = session_rps / echo_rps;
    Ok(vec![
        json!({
            "system": "orbite", "route": "grpc", "workload": "G1-session-rpc",
            "echo_p50_us": round(echo_us.0, 1), "echo_p99_us": round(echo_us.1, 1),
            "life_p50_us": round(life_us.0, 1), "life_p99_us": round(life_us.1, 1),
            "rpcs_per_life": 5, "lives": n_life, "x_echo": round(g1, 2), "bar": 6.0,
            "verified": attached && clean,
            "summary": format!(
                "session life (5 RPCs) p50 {:.1} us, echo RPC p50 {:.1} us: {:.2}x echo (bar 6x)",
                life_us.0, echo_us.0, g1
            ),
        }),
        json!({
            "system": "orbite", "route": "grpc", "workload": "G2-session-rpc-16",
            "clients": clients, "seconds": secs, "echo_rpcs_per_s": echo_rps.round(),
            "session_rpcs_per_s": session_rps.round(), "x_echo": round(g2, 2), "bar": 0.8,
            "verified": ok2 && clean,
            "summary": format!(
                "{clients} clients: session RPCs {:.0}/s, echo RPCs {:.0}/s: {:.2}x echo (bar 0.8x)",
                session_rps, echo_rps, g2
            ),
        }),
    ])
}
