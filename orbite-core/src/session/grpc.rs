//! The KV session service over gRPC (feature `grpc`): `OpenEngineKv` of
//! proto/orbite/kv/v1/kv_session.proto, served by tonic over a
//! [`KvSessionService`].
//!
//! An engine that owns its KV memory embeds it: build a
//! [`KvSessionService`] over its [`crate::TransferEngine`], start its
//! reaper, and serve [`KvGrpcService`] (alone with [`KvGrpcService::serve`]
//! or next to its own services with [`KvGrpcService::routes`]).
//! `orbite serve` is the same as a standalone process.
//!
//! Every request is checked before anything changes: required fields,
//! lengths, enumeration values, session ids; refusals carry the code and
//! the `google.rpc.ErrorInfo` of [`super::status::STATUS_TABLE`]. A message
//! that does not decode is refused with INVALID_ARGUMENT (reason
//! `MALFORMED_MESSAGE`), one above the size limit by tonic before it is
//! decoded.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};
use tonic_types::{ErrorDetails, StatusExt};

use super::status::ERROR_DOMAIN;
use super::{
    AllocateRequest, AttachOutcome, KvError, KvScheduleStyle, KvServiceStats, KvSession, KvSessionService,
    KvTransferDisposition, KvTransferMeta, SessionId,
};
use crate::{Desc, RegistrationId};

/// The code generated from the proto file.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("orbite.kv.v1");
}

/// The codec of every method: prost's, except that a message that does not
/// decode is INVALID_ARGUMENT (the caller's fault), with reason
/// `MALFORMED_MESSAGE`.
pub mod codec {
    use std::marker::PhantomData;

    use tonic::Status;
    use tonic::codec::{BufferSettings, DecodeBuf};
    use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

    /// Prost's codec with the decode errors mapped.
    #[derive(Debug, Clone)]
    pub struct Codec<T, U>(PhantomData<(T, U)>);

    impl<T, U> Default for Codec<T, U> {
        fn default() -> Self {
            Codec(PhantomData)
        }
    }

    /// Prost's decoder with the decode errors mapped.
    #[derive(Debug, Clone, Default)]
    pub struct Decoder<U>(ProstDecoder<U>);

    impl<T, U> tonic::codec::Codec for Codec<T, U>
    where
        T: prost::Message + Send + 'static,
        U: prost::Message + Default + Send + 'static,
    {
        type Encode = T;
        type Decode = U;
        type Encoder = ProstEncoder<T>;
        type Decoder = Decoder<U>;

        fn encoder(&mut self) -> ProstEncoder<T> {
            ProstCodec::<T, U>::default().encoder()
        }

        fn decoder(&mut self) -> Decoder<U> {
            Decoder(ProstCodec::<T, U>::default().decoder())
        }
    }

    impl<U: prost::Message + Default> tonic::codec::Decoder for Decoder<U> {
        type Item = U;
        type Error = Status;

        fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
            self.0.decode(buf).map_err(|e| super::malformed(e.message()))
        }

        fn buffer_settings(&self) -> BufferSettings {
            self.0.buffer_settings()
        }
    }
}

fn malformed(what: &str) -> Status {
    let mut m = HashMap::new();
    m.insert("detail".to_owned(), what.chars().take(200).collect::<String>());
    Status::with_error_details(
        tonic::Code::InvalidArgument,
        format!("the request is not a valid message of its type: {what}"),
        ErrorDetails::with_error_info("MALFORMED_MESSAGE", ERROR_DOMAIN, m),
    )
}

/// The status of a refusal: its code and `ErrorInfo` from the status table.
pub fn status_of(e: &KvError) -> Status {
    let row = e.status();
    let metadata: HashMap<String, String> = e.metadata().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    // GrpcCode's values are gRPC's own numbers.
    Status::with_error_details(
        tonic::Code::from_i32(row.code as i32),
        e.to_string(),
        ErrorDetails::with_error_info(row.reason, ERROR_DOMAIN, metadata),
    )
}

fn refuse(e: KvError) -> Status {
    status_of(&e)
}

// The library's enumerations carry the protocol's values.
fn style_in(v: i32) -> Result<KvScheduleStyle, KvError> {
    use KvScheduleStyle::*;
    let all = [Unspecified, ContextFirst, GenerationFirst, Concurrent];
    all.into_iter()
        .find(|&s| s as i32 == v)
        .ok_or_else(|| KvError::InvalidValue { field: "style", value: v.to_string() })
}

fn disposition_in(v: i32) -> Result<KvTransferDisposition, KvError> {
    use KvTransferDisposition::*;
    let all = [Unspecified, Required, Bypass];
    all.into_iter()
        .find(|&d| d as i32 == v)
        .ok_or_else(|| KvError::InvalidValue { field: "disposition", value: v.to_string() })
}

fn session_id(s: &str) -> Result<SessionId, KvError> {
    if s.is_empty() {
        return Err(KvError::MissingField("session_id"));
    }
    s.parse()
}

impl From<proto::KvTransferMeta> for KvTransferMeta {
    fn from(m: proto::KvTransferMeta) -> Self {
        KvTransferMeta { layout: m.layout, block_bytes: m.block_bytes, blocks: m.blocks }
    }
}

fn meta_in(m: Option<proto::KvTransferMeta>) -> Result<KvTransferMeta, KvError> {
    m.map(Into::into).ok_or(KvError::MissingField("meta"))
}

fn timestamp(unix_ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp { seconds: unix_ms.div_euclid(1000), nanos: (unix_ms.rem_euclid(1000) * 1_000_000) as i32 }
}

fn range_out(registration: u64, offset: u64, len: u64) -> proto::KvRange {
    proto::KvRange { registration, offset, len }
}

/// What a drain did and left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// The postcondition holds: nothing live, pinned or tracked, every
    /// ended session cleaned up.
    pub drained: bool,
    /// Sessions aborted at the timeout.
    pub aborted: u64,
    /// What the service held at the end.
    pub stats: KvServiceStats,
}

/// The gRPC face of a [`KvSessionService`].
#[derive(Clone)]
pub struct KvGrpcService {
    service: Arc<KvSessionService>,
    regions: Arc<Vec<Desc>>,
    max_message_bytes: usize,
}

impl std::fmt::Debug for KvGrpcService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvGrpcService").field("service", &self.service).finish()
    }
}

/// Largest request a server decodes unless told otherwise.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1 << 20;

impl KvGrpcService {
    /// The gRPC service over `service` (whose reaper the caller starts).
    pub fn new(service: Arc<KvSessionService>) -> Self {
        KvGrpcService { service, regions: Arc::new(Vec::new()), max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES }
    }

    /// Lists `regions` (whole registrations of the service's engine) in the
    /// stats, as memory producers may name when they mark KV ready.
    pub fn with_kv_regions(mut self, regions: Vec<Desc>) -> Self {
        self.regions = Arc::new(regions);
        self
    }

    /// Requests above `bytes` are refused before they are decoded.
    pub fn with_max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// The session service underneath.
    pub fn service(&self) -> &Arc<KvSessionService> {
        &self.service
    }

    /// `OpenEngineKv` and `OrbiteDiagnostics`, to add to a tonic server
    /// next to an engine's own services.
    pub fn routes(&self) -> tonic::service::Routes {
        let kv = proto::open_engine_kv_server::OpenEngineKvServer::new(self.clone())
            .max_decoding_message_size(self.max_message_bytes);
        let diag = proto::orbite_diagnostics_server::OrbiteDiagnosticsServer::new(Diagnostics)
            .max_decoding_message_size(self.max_message_bytes);
        tonic::service::Routes::new(kv).add_service(diag)
    }

    /// Serves on `listener` until `shutdown` completes (in-flight calls
    /// finish first).
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        // Nodelay on every accepted socket: with Nagle a response's
        // trailers wait for the ACK of its data (delayed ACK: ~40 ms).
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tonic::transport::Server::builder()
            .add_routes(self.routes())
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
    }

    /// Stops new allocations; waits up to `timeout` for live sessions to
    /// end; with `abort_remaining`, aborts what is still live and waits up
    /// to `timeout` again for its work to retire. The reaper keeps
    /// running meanwhile (leases still expire).
    pub async fn drain(&self, timeout: Duration, abort_remaining: bool) -> DrainReport {
        self.service.start_drain();
        let mut drained = self.settle(Instant::now() + timeout).await;
        let mut aborted = 0;
        if !drained && abort_remaining {
            aborted = self.service.abort_live();
            drained = self.settle(Instant::now() + timeout).await;
        }
        DrainReport { drained, aborted, stats: self.service.stats() }
    }

    /// Polls until the service is drained (nothing live, every ended
    /// session cleaned up, no pin or transfer held by a session) or
    /// `deadline` passes; returns whether it drained.
    async fn settle(&self, deadline: Instant) -> bool {
        loop {
            self.service.poll();
            if self.service.is_drained() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    fn session_out(&self, s: &KvSession) -> proto::KvSession {
        proto::KvSession {
            session_id: s.session_id.to_string(),
            request_id: s.request_id.clone(),
            model: s.model.clone(),
            idempotency_key: s.idempotency_key.clone(),
            style: s.style as i32,
            effective_style: s.effective_style as i32,
            disposition: s.disposition as i32,
            state: s.state as i32,
            lease_expires_at: Some(timestamp(self.service.unix_ms(s.lease_expires_at_ms))),
            consumer_queued: s.consumer_queued,
            rendezvous: Some(proto::KvRendezvous {
                endpoint: s.rendezvous.endpoint.clone(),
                epoch: s.rendezvous.epoch,
                session_id: s.rendezvous.session_id.to_string(),
                ranges: s.rendezvous.ranges.iter().map(|r| range_out(r.registration, r.offset, r.len)).collect(),
            }),
            meta: Some(proto::KvTransferMeta {
                layout: s.meta.layout.clone(),
                block_bytes: s.meta.block_bytes,
                blocks: s.meta.blocks,
            }),
            reason: s.reason.clone(),
        }
    }

    fn reply(&self, r: Result<KvSession, KvError>) -> Result<Response<proto::KvSession>, Status> {
        r.map(|s| Response::new(self.session_out(&s))).map_err(refuse)
    }

    fn stats_out(&self, s: &KvServiceStats) -> proto::KvSessionStats {
        proto::KvSessionStats {
            incarnation: format!("{:016x}", s.incarnation),
            draining: s.draining,
            live_sessions: s.live_sessions,
            tombstones: s.tombstones,
            awaiting_cleanup: s.awaiting_cleanup,
            pinned_ranges: s.pinned_ranges,
            tracked_transfers: s.tracked_transfers,
            engine_executions: s.engine_executions,
            sessions_expired: s.sessions_expired,
            reaper_ticks: s.reaper_ticks,
            kv_regions: self.regions.iter().map(|d| range_out(d.registration.to_raw(), d.offset, d.len)).collect(),
        }
    }
}

#[tonic::async_trait]
impl proto::open_engine_kv_server::OpenEngineKv for KvGrpcService {
    async fn allocate_kv_session(
        &self,
        request: Request<proto::AllocateKvSessionRequest>,
    ) -> Result<Response<proto::KvSession>, Status> {
        let r = request.into_inner();
        // The library's order (docs/api.md): the text fields first, then
        // the style and disposition (converted here), then the lease and
        // the metadata (an absent `meta` is refused as `meta`).
        let layout = r.meta.as_ref().map_or("", |m| m.layout.as_str());
        self.service.check_allocate_fields(&r.request_id, &r.model, &r.idempotency_key, layout).map_err(refuse)?;
        let absent_meta = r.meta.is_none();
        let req = (|| {
            Ok::<_, KvError>(AllocateRequest {
                style: style_in(r.style)?,
                disposition: disposition_in(r.disposition)?,
                meta: r.meta.map(Into::into).unwrap_or_default(),
                request_id: r.request_id,
                model: r.model,
                idempotency_key: r.idempotency_key,
                lease_ms: r.lease_ms,
            })
        })()
        .map_err(refuse)?;
        let result = self.service.allocate(&req).map_err(|e| match e {
            KvError::MissingField("meta.layout") if absent_meta => KvError::MissingField("meta"),
            e => e,
        });
        self.reply(result)
    }

    async fn get_kv_session(
        &self,
        request: Request<proto::GetKvSessionRequest>,
    ) -> Result<Response<proto::KvSession>, Status> {
        let id = session_id(&request.get_ref().session_id).map_err(refuse)?;
        self.reply(self.service.get(id))
    }

    async fn renew_kv_session(
        &self,
        request: Request<proto::RenewKvSessionRequest>,
    ) -> Result<Response<proto::KvSession>, Status> {
        let r = request.get_ref();
        let id = session_id(&r.session_id).map_err(refuse)?;
        self.reply(self.service.renew(id, r.lease_ms))
    }

    async fn release_kv_session(
        &self,
        request: Request<proto::ReleaseKvSessionRequest>,
    ) -> Result<Response<proto::ReleaseKvSessionResponse>, Status> {
        let id = session_id(&request.get_ref().session_id).map_err(refuse)?;
        // Whether this call ended it: the state before, under the same
        // rules (a due lease counts as ended).
        let s = self.service.release_reporting(id).map_err(refuse)?;
        Ok(Response::new(proto::ReleaseKvSessionResponse {
            session_id: s.0.session_id.to_string(),
            state: s.0.state as i32,
            released_now: s.1,
            reason: s.0.reason,
        }))
    }

    async fn abort_kv_session(
        &self,
        request: Request<proto::AbortKvSessionRequest>,
    ) -> Result<Response<proto::KvSession>, Status> {
        let id = session_id(&request.get_ref().session_id).map_err(refuse)?;
        self.reply(self.service.abort(id))
    }

    async fn mark_kv_session_ready(
        &self,
        request: Request<proto::MarkKvSessionReadyRequest>,
    ) -> Result<Response<proto::KvSession>, Status> {
        let r = request.into_inner();
        let id = session_id(&r.session_id).map_err(refuse)?;
        let meta = meta_in(r.meta).map_err(refuse)?;
        let ranges: Vec<Desc> = r
            .ranges
            .iter()
            .map(|g| Desc { registration: RegistrationId::from_raw(g.registration), offset: g.offset, len: g.len })
            .collect();
        self.reply(self.service.mark_ready(id, &ranges, &meta))
    }

    async fn attach_kv_session(
        &self,
        request: Request<proto::AttachKvSessionRequest>,
    ) -> Result<Response<proto::AttachKvSessionResponse>, Status> {
        let r = request.into_inner();
        let id = session_id(&r.session_id).map_err(refuse)?;
        let meta = meta_in(r.meta).map_err(refuse)?;
        let (session, queued) = match self.service.attach(id, &meta).map_err(refuse)? {
            AttachOutcome::Attached(s) => (s, false),
            AttachOutcome::Queued(s) => (s, true),
        };
        Ok(Response::new(proto::AttachKvSessionResponse { session: Some(self.session_out(&session)), queued }))
    }

    async fn complete_kv_session(
        &self,
        request: Request<proto::CompleteKvSessionRequest>,
    ) -> Result<Response<proto::KvSession>, Status> {
        let id = session_id(&request.get_ref().session_id).map_err(refuse)?;
        self.reply(self.service.complete(id))
    }

    async fn bypass_kv_session(
        &self,
        request: Request<proto::BypassKvSessionRequest>,
    ) -> Result<Response<proto::KvSession>, Status> {
        let id = session_id(&request.get_ref().session_id).map_err(refuse)?;
        self.reply(self.service.bypass(id))
    }

    async fn reject_kv_session(
        &self,
        request: Request<proto::RejectKvSessionRequest>,
    ) -> Result<Response<proto::KvSession>, Status> {
        let r = request.get_ref();
        let id = session_id(&r.session_id).map_err(refuse)?;
        self.reply(self.service.reject(id, &r.reason))
    }

    async fn fail_kv_session(
        &self,
        request: Request<proto::FailKvSessionRequest>,
    ) -> Result<Response<proto::KvSession>, Status> {
        let r = request.get_ref();
        let id = session_id(&r.session_id).map_err(refuse)?;
        self.reply(self.service.fail(id, &r.reason))
    }

    async fn check_sessionless_decode(
        &self,
        request: Request<proto::CheckSessionlessDecodeRequest>,
    ) -> Result<Response<proto::CheckSessionlessDecodeResponse>, Status> {
        let d = disposition_in(request.get_ref().disposition).map_err(refuse)?;
        self.service.check_sessionless_decode(d).map_err(refuse)?;
        Ok(Response::new(proto::CheckSessionlessDecodeResponse {}))
    }

    async fn drain_kv_sessions(
        &self,
        request: Request<proto::DrainKvSessionsRequest>,
    ) -> Result<Response<proto::DrainKvSessionsResponse>, Status> {
        let r = request.get_ref();
        let timeout = match r.timeout_ms {
            None => Duration::ZERO,
            Some(ms) if ms < 0 => {
                return Err(refuse(KvError::InvalidValue { field: "timeout_ms", value: ms.to_string() }));
            }
            // Bounded by the longest lease: by then every session ended.
            Some(ms) => Duration::from_millis((ms as u64).min(self.service.info().max_lease_ms)),
        };
        let report = self.drain(timeout, r.abort_remaining).await;
        let s = report.stats;
        Ok(Response::new(proto::DrainKvSessionsResponse {
            drained: report.drained,
            live_sessions: s.live_sessions,
            pinned_ranges: s.pinned_ranges,
            tracked_transfers: s.tracked_transfers,
            awaiting_cleanup: s.awaiting_cleanup,
            aborted: report.aborted,
        }))
    }

    async fn get_kv_connector_info(
        &self,
        _request: Request<proto::GetKvConnectorInfoRequest>,
    ) -> Result<Response<proto::KvConnectorInfo>, Status> {
        let i = self.service.info();
        let engine = self.service.engine();
        Ok(Response::new(proto::KvConnectorInfo {
            supported_styles: i.supported_styles.iter().map(|&s| s as i32).collect(),
            default_style: i.default_style as i32,
            caller_allocation: i.caller_allocation,
            renewable_leases: i.renewable_leases,
            explicit_release: i.explicit_release,
            conditional_bypass: i.conditional_bypass,
            session_lookup: i.session_lookup,
            local_prefill: i.local_prefill,
            limits: Some(proto::KvLimits {
                max_live_sessions: i.max_live_sessions,
                default_lease_ms: i.default_lease_ms,
                max_lease_ms: i.max_lease_ms,
                tombstone_retention_ms: i.tombstone_retention_ms,
                max_tombstones: i.max_tombstones,
                max_field_bytes: i.max_field_bytes,
                max_ranges: i.max_ranges,
                max_message_bytes: self.max_message_bytes as u64,
            }),
            schema_version: SCHEMA_VERSION,
            incarnation: format!("{:016x}", self.service.incarnation()),
            endpoint: engine.endpoint().unwrap_or_default(),
            epoch: engine.source_epoch(),
        }))
    }

    async fn get_kv_session_stats(
        &self,
        _request: Request<proto::GetKvSessionStatsRequest>,
    ) -> Result<Response<proto::KvSessionStats>, Status> {
        Ok(Response::new(self.stats_out(&self.service.stats())))
    }
}

/// The schema version `GetKvConnectorInfo` reports.
pub const SCHEMA_VERSION: u32 = 1;

/// `OrbiteDiagnostics`: the echo reference.
#[derive(Debug, Clone, Copy, Default)]
pub struct Diagnostics;

#[tonic::async_trait]
impl proto::orbite_diagnostics_server::OrbiteDiagnostics for Diagnostics {
    async fn echo(&self, request: Request<proto::EchoRequest>) -> Result<Response<proto::EchoResponse>, Status> {
        Ok(Response::new(proto::EchoResponse { payload: request.into_inner().payload }))
    }
}

#[cfg(test)]
mod tests {
    use super::super::status::STATUS_TABLE;
    use super::*;

    #[test]
    fn codes_are_tonics_of_the_same_name() {
        for row in STATUS_TABLE {
            let c = tonic::Code::from_i32(row.code as i32);
            assert_eq!(format!("{c:?}"), format!("{:?}", row.code));
        }
    }

    #[test]
    fn style_and_disposition_take_the_protos_values() {
        for v in -2..10 {
            let style = proto::KvScheduleStyle::try_from(v).ok().map(|p| p as i32);
            assert_eq!(style_in(v).ok().map(|s| s as i32), style, "{v}");
            let disposition = proto::KvTransferDisposition::try_from(v).ok().map(|p| p as i32);
            assert_eq!(disposition_in(v).ok().map(|d| d as i32), disposition, "{v}");
            for s in [style_in(v).err(), disposition_in(v).err()].into_iter().flatten() {
                assert!(matches!(s, KvError::InvalidValue { .. }), "{s:?}");
            }
        }
    }
}
