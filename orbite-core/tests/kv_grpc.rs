//! The KV session service over gRPC (feature `grpc`), in process: a real
//! tonic server on loopback and the generated client. The black-box suite
//! (scripts/session-conformance) covers the contract case by case; these
//! tests pin what the Rust side owns: the status table on the wire, ids
//! across a restart on the same port, wall-clock expiry, the reaper, drain.
#![cfg(feature = "grpc")]

mod common;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use orbite_core::session::grpc::proto::open_engine_kv_client::OpenEngineKvClient;
use orbite_core::session::grpc::proto::*;
use orbite_core::session::grpc::{KvGrpcService, status_of};
use orbite_core::session::status::STATUS_TABLE;
use orbite_core::session::{KvConnectorInfo, KvError, KvSessionService, SystemClock};
use orbite_core::*;
use tonic::transport::Channel;
use tonic_types::StatusExt;

struct Server {
    addr: std::net::SocketAddr,
    service: Arc<KvSessionService>,
    region: Region,
    engine: TransferEngine,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>>,
    _reaper: orbite_core::session::Reaper,
}

impl Server {
    async fn start(at: &str) -> Server {
        let engine = engine("{}");
        let region = region(&engine, 65536, Permission::RemoteRead);
        let service = Arc::new(KvSessionService::new(
            engine.clone(),
            KvConnectorInfo::default(),
            Arc::new(SystemClock::default()),
        ));
        let reaper = service.start_reaper(Duration::from_millis(2)).unwrap();
        let grpc = KvGrpcService::new(service.clone()).with_kv_regions(vec![Desc::new(region.id, 0, 65536)]);
        let listener = tokio::net::TcpListener::bind(at).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(grpc.serve(listener, async {
            let _ = rx.await;
        }));
        Server { addr, service, region, engine, stop: Some(tx), task: Some(task), _reaper: reaper }
    }

    async fn client(&self) -> OpenEngineKvClient<Channel> {
        OpenEngineKvClient::connect(format!("http://{}", self.addr)).await.unwrap()
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap().unwrap();
        let st = self.service.stats();
        assert_eq!((st.live_sessions, st.pinned_ranges, st.tracked_transfers), (0, 0, 0));
        self.engine.deregister(self.region.id).unwrap();
        assert_idle(&self.engine);
    }
}

fn meta() -> KvTransferMeta {
    KvTransferMeta { layout: "grpc-test:bf16".into(), block_bytes: 4096, blocks: 2 }
}

fn alloc(key: &str, lease_ms: Option<i64>) -> AllocateKvSessionRequest {
    AllocateKvSessionRequest {
        request_id: format!("req-{key}"),
        model: "m".into(),
        idempotency_key: key.into(),
        style: KvScheduleStyle::ContextFirst as i32,
        disposition: KvTransferDisposition::Required as i32,
        lease_ms,
        meta: Some(meta()),
    }
}

/// The code and `ErrorInfo` reason of a refusal, and that it has exactly
/// one detail of the right domain.
fn refusal(s: tonic::Status) -> (tonic::Code, String) {
    let details = s.get_error_details();
    let info = details.error_info().unwrap_or_else(|| panic!("no ErrorInfo in {s:?}"));
    assert_eq!(info.domain, "orbite.kv.v1");
    (s.code(), info.reason.clone())
}

fn unix_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_first_session_over_grpc_pins_then_gives_everything_back() {
    let server = Server::start("127.0.0.1:0").await;
    let mut c = server.client().await;
    let info = c.get_kv_connector_info(GetKvConnectorInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.schema_version, 1);
    assert_eq!(info.incarnation, format!("{:016x}", server.service.incarnation()));
    let s = c.allocate_kv_session(alloc("flow", Some(5_000))).await.unwrap().into_inner();
    assert!(s.session_id.starts_with(&info.incarnation), "{}", s.session_id);
    let at = s.lease_expires_at.unwrap();
    let at_ms = at.seconds * 1000 + i64::from(at.nanos) / 1_000_000;
    assert!((at_ms - 5_000 - unix_ms()).abs() < 1_000, "expiry {at_ms} is not now + 5 s");
    let stats = c.get_kv_session_stats(GetKvSessionStatsRequest {}).await.unwrap().into_inner();
    let region = stats.kv_regions[0];
    let ranges = vec![
        KvRange { registration: region.registration, offset: 0, len: 4096 },
        KvRange { registration: region.registration, offset: 8192, len: 4096 },
    ];
    let ready = c
        .mark_kv_session_ready(MarkKvSessionReadyRequest {
            session_id: s.session_id.clone(),
            ranges: ranges.clone(),
            meta: Some(meta()),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ready.state, KvSessionState::Ready as i32);
    assert_eq!(server.engine.stats().pinned_ranges, 2);
    let a = c
        .attach_kv_session(AttachKvSessionRequest { session_id: s.session_id.clone(), meta: Some(meta()) })
        .await
        .unwrap()
        .into_inner();
    assert!(!a.queued);
    assert_eq!(a.session.unwrap().rendezvous.unwrap().ranges, ranges);
    c.complete_kv_session(CompleteKvSessionRequest { session_id: s.session_id.clone() }).await.unwrap();
    let r = c.release_kv_session(ReleaseKvSessionRequest { session_id: s.session_id.clone() }).await.unwrap();
    let r = r.into_inner();
    assert_eq!((r.state, r.released_now), (KvSessionState::Complete as i32, false));
    assert_eq!(server.engine.stats().pinned_ranges, 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_carry_the_status_tables_code_and_reason_and_change_nothing() {
    let server = Server::start("127.0.0.1:0").await;
    let mut c = server.client().await;
    let row = |reason: &str| {
        let r = STATUS_TABLE.iter().find(|r| r.reason == reason).unwrap();
        (tonic::Code::from_i32(r.code as i32), reason.to_owned())
    };
    let e = c.allocate_kv_session(AllocateKvSessionRequest { request_id: String::new(), ..alloc("r", None) }).await;
    assert_eq!(refusal(e.unwrap_err()), row("MISSING_FIELD"));
    let e = c.allocate_kv_session(AllocateKvSessionRequest { style: 77, ..alloc("r", None) }).await;
    assert_eq!(refusal(e.unwrap_err()), row("INVALID_VALUE"));
    let e = c.allocate_kv_session(AllocateKvSessionRequest { lease_ms: Some(0), ..alloc("r", None) }).await;
    assert_eq!(refusal(e.unwrap_err()), row("INVALID_LEASE"));
    let e = c.allocate_kv_session(AllocateKvSessionRequest { meta: None, ..alloc("r", None) }).await;
    let e = e.unwrap_err();
    assert!(e.message().contains("`meta`"), "{e:?}");
    assert_eq!(refusal(e), row("MISSING_FIELD"));
    let e = c.get_kv_session(GetKvSessionRequest { session_id: "not-an-id".into() }).await;
    assert_eq!(refusal(e.unwrap_err()), row("INVALID_VALUE"));
    let s = c.allocate_kv_session(alloc("r", None)).await.unwrap().into_inner();
    let e = c.allocate_kv_session(AllocateKvSessionRequest { model: "other".into(), ..alloc("r", None) }).await;
    assert_eq!(refusal(e.unwrap_err()), row("IDEMPOTENCY_CONFLICT"));
    let e = c.attach_kv_session(AttachKvSessionRequest { session_id: s.session_id.clone(), meta: Some(meta()) }).await;
    assert_eq!(refusal(e.unwrap_err()), row("NOT_READY"));
    let e = c
        .mark_kv_session_ready(MarkKvSessionReadyRequest {
            session_id: s.session_id.clone(),
            ranges: vec![KvRange { registration: 0xdead_beef, offset: 0, len: 8192 }],
            meta: Some(meta()),
        })
        .await;
    assert_eq!(refusal(e.unwrap_err()), row("ENGINE_REFUSED"));
    let now = c.get_kv_session(GetKvSessionRequest { session_id: s.session_id.clone() }).await.unwrap();
    assert_eq!(now.into_inner().state, KvSessionState::Allocated as i32, "the refusals changed nothing");
    assert_eq!(server.engine.stats().pinned_ranges, 0);
    c.reject_kv_session(RejectKvSessionRequest { session_id: s.session_id.clone(), reason: String::new() })
        .await
        .unwrap();
    let e = c.complete_kv_session(CompleteKvSessionRequest { session_id: s.session_id.clone() }).await;
    assert_eq!(refusal(e.unwrap_err()), row("SESSION_ENDED"));
    let got = c.get_kv_session(GetKvSessionRequest { session_id: s.session_id }).await.unwrap().into_inner();
    assert_eq!((got.state, got.reason), (KvSessionState::Rejected as i32, None), "an empty reason is none");
    // Every row maps to its code the same way in process.
    for r in STATUS_TABLE {
        assert_eq!(tonic::Code::from_i32(r.code as i32) as i32, r.code as i32);
    }
    assert_eq!(status_of(&KvError::Draining).code(), tonic::Code::Unavailable);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_service_on_the_same_port_never_answers_for_an_old_id() {
    let first = Server::start("127.0.0.1:0").await;
    let addr = first.addr;
    let mut c = first.client().await;
    let old = c.allocate_kv_session(alloc("restart", None)).await.unwrap().into_inner().session_id;
    c.release_kv_session(ReleaseKvSessionRequest { session_id: old.clone() }).await.unwrap();
    drop(c);
    first.stop().await;
    let second = Server::start(&addr.to_string()).await;
    let mut c = second.client().await;
    let new = c.allocate_kv_session(alloc("restart", None)).await.unwrap().into_inner().session_id;
    assert_ne!(new, old, "an id was reused across a restart");
    assert!(old.ends_with("-1") && new.ends_with("-1"), "both are the first of their incarnation");
    for e in [
        c.get_kv_session(GetKvSessionRequest { session_id: old.clone() }).await.map(|_| ()),
        c.release_kv_session(ReleaseKvSessionRequest { session_id: old.clone() }).await.map(|_| ()),
        c.abort_kv_session(AbortKvSessionRequest { session_id: old.clone() }).await.map(|_| ()),
    ] {
        assert_eq!(refusal(e.unwrap_err()), (tonic::Code::NotFound, "OTHER_INCARNATION".to_owned()));
    }
    c.release_kv_session(ReleaseKvSessionRequest { session_id: new }).await.unwrap();
    second.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_expire_without_calls_and_drain_leaves_nothing() {
    let server = Server::start("127.0.0.1:0").await;
    let mut c = server.client().await;
    let region = c.get_kv_session_stats(GetKvSessionStatsRequest {}).await.unwrap().into_inner().kv_regions[0];
    let short = c.allocate_kv_session(alloc("short", Some(50))).await.unwrap().into_inner();
    c.mark_kv_session_ready(MarkKvSessionReadyRequest {
        session_id: short.session_id.clone(),
        ranges: vec![KvRange { registration: region.registration, offset: 0, len: 8192 }],
        meta: Some(meta()),
    })
    .await
    .unwrap();
    let live = c.allocate_kv_session(alloc("live", None)).await.unwrap().into_inner();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s = c.get_kv_session_stats(GetKvSessionStatsRequest {}).await.unwrap().into_inner();
    assert_eq!((s.live_sessions, s.pinned_ranges, s.sessions_expired), (1, 0, 1), "{s:?}");
    let got = c.get_kv_session(GetKvSessionRequest { session_id: short.session_id }).await.unwrap();
    assert_eq!(got.into_inner().state, KvSessionState::Expired as i32);
    let d = c
        .drain_kv_sessions(DrainKvSessionsRequest { timeout_ms: Some(50), abort_remaining: true })
        .await
        .unwrap()
        .into_inner();
    assert!(d.drained && d.aborted == 1 && d.live_sessions == 0, "{d:?}");
    let got = c.get_kv_session(GetKvSessionRequest { session_id: live.session_id }).await.unwrap();
    assert_eq!(got.into_inner().state, KvSessionState::Cancelled as i32);
    let e = c.allocate_kv_session(alloc("after-drain", None)).await;
    assert_eq!(refusal(e.unwrap_err()), (tonic::Code::Unavailable, "DRAINING".to_owned()));
    // An identical retry is still answered.
    let again = c.allocate_kv_session(alloc("live", None)).await.unwrap().into_inner();
    assert_eq!(again.state, KvSessionState::Cancelled as i32);
    server.stop().await;
}
