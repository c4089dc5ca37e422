//! Conformance suite of the KV session protocol (orbite_core::session): the
//! five normative flows (context-first, generation-first, concurrent,
//! conditional bypass, rejection and failure), both abort/release orders
//! with a transfer in flight, cancellation mid-transfer, peer loss in a real
//! two-process transfer, leases (expiry while queued, renewal, nothing
//! immortal), drain, and every presence/default/validation rule.
//!
//! Time is a `ManualClock`; transfers are held with the local route's fault
//! hooks. Every test ends at the engine's baseline: nothing pinned, nothing
//! prepared, nothing fenced (`Fixture::finish`).

mod common;
mod peer;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::*;
use orbite_core::fault::FaultDirective;
use orbite_core::session::*;
use orbite_core::*;
use peer::PeerProcess;

#[test]
fn peer_process_entry() {
    peer::entry();
}

use KvScheduleStyle::{Concurrent, ContextFirst, GenerationFirst, Unspecified};
use KvSessionState::{Allocated, Attached, Bypassed, Cancelled, Complete, Expired, Failed, Ready, Rejected, Released};

const LAYOUT: &str = "llama-3-8b/bf16/16x128";
const MODEL: &str = "llama-3-8b";
const KV: usize = 64 * 1024;
/// The KV of one session: 4 blocks of 4 KiB, pinned as two 8 KiB ranges.
const BLOCK: u64 = 4096;
const BLOCKS: u64 = 4;
const LEASE: i64 = 10_000;

fn meta() -> KvTransferMeta {
    KvTransferMeta { layout: LAYOUT.into(), block_bytes: BLOCK, blocks: BLOCKS }
}

fn request(key: &str, style: KvScheduleStyle) -> AllocateRequest {
    AllocateRequest {
        request_id: format!("req-{key}"),
        model: MODEL.into(),
        idempotency_key: key.into(),
        style,
        disposition: KvTransferDisposition::Required,
        lease_ms: Some(LEASE),
        meta: meta(),
    }
}

fn bypass_request(key: &str, style: KvScheduleStyle) -> AllocateRequest {
    AllocateRequest { disposition: KvTransferDisposition::Bypass, ..request(key, style) }
}

/// An engine, its KV session service on a manual clock, the producer's KV
/// region and the consumer's landing region.
struct Fixture {
    e: TransferEngine,
    clock: Arc<ManualClock>,
    svc: KvSessionService,
    base: Stats,
    kv: Region,
    dst: Region,
    kv_registered: bool,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture::with("{}", KvConnectorInfo::default(), KV)
    }

    fn info(info: KvConnectorInfo) -> Fixture {
        Fixture::with("{}", info, KV)
    }

    fn with(config: &str, info: KvConnectorInfo, len: usize) -> Fixture {
        let e = engine(config);
        let base = e.stats();
        let kv = region(&e, len, Permission::RemoteReadWrite);
        let dst = region(&e, len, Permission::RemoteReadWrite);
        fill(&kv.mem, 0x5EED);
        let clock = Arc::new(ManualClock::default());
        let svc = KvSessionService::new(e.clone(), info, clock.clone());
        Fixture { e, clock, svc, base, kv, dst, kv_registered: true }
    }

    /// The id of this service's `seq`th session.
    fn sid(&self, seq: u64) -> SessionId {
        SessionId { incarnation: self.svc.incarnation(), seq }
    }

    /// The producer's KV of one session.
    fn kv_ranges(&self) -> Vec<Desc> {
        vec![Desc::new(self.kv.id, 0, 8192), Desc::new(self.kv.id, 16384, 8192)]
    }

    fn kv_refs(&self) -> Vec<KvRangeRef> {
        self.kv_ranges()
            .iter()
            .map(|d| KvRangeRef { registration: d.registration.to_raw(), offset: d.offset, len: d.len })
            .collect()
    }

    /// What the consumer must hold after reading the session's KV.
    fn kv_bytes(&self) -> Vec<u8> {
        let kv = snapshot(&self.kv.mem);
        [&kv[0..8192], &kv[16384..24576]].concat()
    }

    fn allocate(&self, req: &AllocateRequest) -> SessionId {
        self.svc.allocate(req).unwrap().session_id
    }

    /// A session whose producer pinned its KV.
    fn ready(&self, req: &AllocateRequest) -> SessionId {
        let id = self.allocate(req);
        assert_eq!(self.svc.mark_ready(id, &self.kv_ranges(), &meta()).unwrap().state, Ready);
        id
    }

    fn attach(&self, id: SessionId) -> KvSession {
        match self.svc.attach(id, &meta()).unwrap() {
            AttachOutcome::Attached(s) => s,
            other => panic!("not attached: {other:?}"),
        }
    }

    fn state(&self, id: SessionId) -> KvSessionState {
        self.svc.get(id).unwrap().state
    }

    fn pinned(&self) -> u64 {
        self.e.stats().pinned_ranges
    }

    /// The consumer's read of the session's KV into `dst` (one task),
    /// posted.
    fn read(&self) -> Transfer {
        let l = [Desc::new(self.dst.id, 0, 16384)];
        let t = self.e.prepare(&spec(Op::Read, &l, &self.kv_ranges())).unwrap();
        assert_eq!(t.shape().1, 1);
        t.post().unwrap();
        t
    }

    fn track(&self, id: SessionId, t: Transfer) {
        if let Err((_, e)) = self.svc.track_transfer(id, t) {
            panic!("track_transfer({id}) refused: {e}");
        }
    }

    fn deregister_kv(&mut self) {
        self.e.deregister(self.kv.id).unwrap();
        self.kv_registered = false;
    }

    /// Nothing live, nothing pinned; drains; then, once the test's own
    /// registrations and memory are gone, the engine's charges are exactly
    /// the baseline taken before them (checked while the service is still
    /// alive: it cannot free a leak by being dropped).
    fn finish(self) {
        self.svc.poll();
        assert_eq!(self.svc.live_count(), 0, "a session is still live");
        assert_eq!(self.pinned(), 0, "a pinned range remains");
        self.svc.start_drain();
        self.svc.poll();
        assert!(self.svc.is_drained(), "the service did not drain");
        assert_idle(&self.e);
        let Fixture { e, svc, base, kv, dst, kv_registered, .. } = self;
        if kv_registered {
            e.deregister(kv.id).unwrap();
        }
        e.deregister(dst.id).unwrap();
        drop((kv, dst));
        assert_eq!(e.stats(), base, "the engine's charges are not at baseline");
        drop(svc);
    }
}

fn poll_until(svc: &KvSessionService, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    loop {
        svc.poll();
        if done() {
            return;
        }
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

// ---------------------------------------------------------------------------
// The five flows.

/// Flow 1: the producer computes, the session becomes ready, the consumer
/// attaches, the transfer completes, release follows.
#[test]
fn flow_context_first_ready_attach_transfer_complete_release() {
    let f = Fixture::new();
    let s = f.svc.allocate(&request("cf", ContextFirst)).unwrap();
    let id = s.session_id;
    assert_eq!(
        (s.state, s.style, s.effective_style, s.consumer_queued),
        (Allocated, ContextFirst, ContextFirst, false)
    );
    assert_eq!(
        s.rendezvous,
        KvRendezvous {
            endpoint: f.e.endpoint().unwrap_or_default(),
            epoch: f.e.source_epoch(),
            session_id: id,
            ranges: vec![]
        }
    );
    assert_eq!((s.request_id.as_str(), s.model.as_str(), s.idempotency_key.as_str()), ("req-cf", MODEL, "cf"));
    assert_eq!((s.meta.clone(), s.reason.clone(), s.lease_expires_at_ms), (meta(), None, LEASE as u64));
    // An early consumer is told to retry: context-first does not queue.
    assert_eq!(f.svc.attach(id, &meta()), Err(KvError::NotReady(id)));
    let s = f.svc.get(id).unwrap();
    assert_eq!((s.state, s.consumer_queued), (Allocated, false));
    assert_eq!(f.pinned(), 0);
    // The producer filled its KV: pinned and ready.
    let ready = f.svc.mark_ready(id, &f.kv_ranges(), &meta()).unwrap();
    assert_eq!((ready.state, ready.rendezvous.ranges.clone()), (Ready, f.kv_refs()));
    assert_eq!(f.pinned(), 2);
    assert_eq!(f.svc.get(id).unwrap(), ready);
    // The consumer attaches and reads through the rendezvous.
    let att = f.attach(id);
    assert_eq!((att.state, att.rendezvous.ranges.clone()), (Attached, f.kv_refs()));
    f.track(id, f.read());
    assert!(f.e.wait_idle(WAIT));
    assert_eq!(f.svc.poll(), 1, "a finished transfer does not end the session");
    assert_eq!((f.state(id), f.pinned(), f.e.stats().prepared_transfers), (Attached, 2, 1));
    assert_eq!(snapshot(&f.dst.mem)[..16384], f.kv_bytes()[..]);
    // Complete frees at once: every transfer of the session had retired.
    let done = f.svc.complete(id).unwrap();
    assert_eq!((done.state, done.reason.clone()), (Complete, None));
    assert_eq!((f.pinned(), f.e.stats().prepared_transfers), (0, 0));
    // Release follows (idempotent on the ended session); the tombstone stays.
    assert_eq!(f.svc.release(id).unwrap(), done);
    assert_eq!(f.svc.get(id).unwrap(), done);
    assert_eq!(f.svc.live_count(), 0);
    f.finish();
}

/// Flow 2: the consumer allocates the rendezvous and queues; the producer
/// later fills the same session.
#[test]
fn flow_generation_first_consumer_queues_and_producer_fills_the_same_session() {
    let f = Fixture::new();
    let req = request("gf", GenerationFirst);
    let id = f.allocate(&req);
    match f.svc.attach(id, &meta()).unwrap() {
        AttachOutcome::Queued(s) => assert_eq!((s.state, s.consumer_queued), (Allocated, true)),
        other => panic!("the consumer should queue: {other:?}"),
    }
    // The producer finds the same session: by id, and by retrying the
    // consumer's allocation (the same reference correlates both sides).
    let seen = f.svc.get(id).unwrap();
    assert_eq!((seen.state, seen.consumer_queued, seen.rendezvous.session_id), (Allocated, true, id));
    assert_eq!(f.svc.allocate(&req).unwrap(), seen);
    assert_eq!(f.svc.live_count(), 1);
    let ready = f.svc.mark_ready(id, &f.kv_ranges(), &meta()).unwrap();
    assert_eq!((ready.state, ready.consumer_queued), (Ready, true), "the queued consumer still waits");
    assert_eq!(f.pinned(), 2);
    let att = f.attach(id);
    assert_eq!((att.state, att.consumer_queued), (Attached, false));
    f.track(id, f.read());
    assert!(f.e.wait_idle(WAIT));
    f.svc.poll();
    assert_eq!(snapshot(&f.dst.mem)[..16384], f.kv_bytes()[..]);
    assert_eq!(f.svc.complete(id).unwrap().state, Complete);
    assert_eq!(f.svc.release(id).unwrap().state, Complete);
    assert_eq!(f.pinned(), 0);
    f.finish();
}

/// Flow 3: both participants start at once on one allocated reference; a
/// temporary not-ready state is not a failure.
#[test]
fn flow_concurrent_both_participants_share_one_reference() {
    let f = Fixture::new();
    // Step by step first.
    let req = request("cc", Concurrent);
    let (a, b) = (f.svc.allocate(&req).unwrap(), f.svc.allocate(&req).unwrap());
    assert_eq!(a, b, "both participants get the same session");
    let id = a.session_id;
    assert!(matches!(f.svc.attach(id, &meta()), Ok(AttachOutcome::Queued(_))), "not ready is not a failure");
    assert_eq!(f.svc.renew(id, Some(LEASE)).unwrap().state, Allocated);
    f.svc.mark_ready(id, &f.kv_ranges(), &meta()).unwrap();
    assert_eq!(f.attach(id).state, Attached);
    assert_eq!(f.svc.complete(id).unwrap().state, Complete);
    assert_eq!(f.pinned(), 0);

    // Then with real threads: the producer and the consumer each allocate
    // (the same key) and race; whatever the interleaving, they meet.
    for round in 0..20 {
        let req = request(&format!("race-{round}"), Concurrent);
        let start = Barrier::new(2);
        let (p, c) = std::thread::scope(|s| {
            let producer = s.spawn(|| {
                start.wait();
                let id = f.allocate(&req);
                f.svc.mark_ready(id, &f.kv_ranges(), &meta()).unwrap();
                id
            });
            let consumer = s.spawn(|| {
                start.wait();
                let id = f.allocate(&req);
                let t0 = Instant::now();
                loop {
                    match f.svc.attach(id, &meta()).unwrap() {
                        AttachOutcome::Attached(s) => break (id, s),
                        AttachOutcome::Queued(s) => assert_eq!(s.state, Allocated),
                    }
                    assert!(t0.elapsed() < WAIT, "the consumer never attached");
                    std::thread::yield_now();
                }
            });
            (producer.join().unwrap(), consumer.join().unwrap())
        });
        assert_eq!(p, c.0, "round {round}: one reference");
        assert_eq!(c.1.rendezvous.ranges, f.kv_refs());
        assert_eq!(f.pinned(), 2);
        assert_eq!(f.svc.complete(p).unwrap().state, Complete);
        assert_eq!(f.svc.release(p).unwrap().state, Complete);
        assert_eq!(f.pinned(), 0);
    }
    assert_eq!(f.svc.live_count(), 0);
    f.finish();
}

/// Flow 4: a consumer that may go on without the producer's KV: the
/// session ends Bypassed (freeing any pinned KV), a Required session cannot
/// bypass, and a consumer that cannot go on fails cleanly.
#[test]
fn flow_conditional_bypass_without_producer() {
    let f = Fixture::new();
    // No producer ever shows up: the consumer uses local state.
    let id = f.allocate(&bypass_request("bp-a", Concurrent));
    assert_eq!(f.svc.get(id).unwrap().disposition, KvTransferDisposition::Bypass);
    assert!(matches!(f.svc.attach(id, &meta()), Ok(AttachOutcome::Queued(_))));
    let s = f.svc.bypass(id).unwrap();
    assert_eq!((s.state, s.consumer_queued), (Bypassed, false));
    // A late producer finds the session ended and pins nothing.
    assert_eq!(f.svc.mark_ready(id, &f.kv_ranges(), &meta()), Err(KvError::Terminal { session: id, state: Bypassed }));
    assert_eq!(f.pinned(), 0);
    // The producer had pinned its KV: bypass frees it at once.
    let id = f.ready(&bypass_request("bp-b", ContextFirst));
    assert_eq!(f.pinned(), 2);
    assert_eq!(f.svc.bypass(id).unwrap().state, Bypassed);
    assert_eq!(f.pinned(), 0);
    assert_eq!(f.svc.release(id).unwrap().state, Bypassed);
    // A session that requires the transfer cannot be bypassed.
    let id = f.allocate(&request("bp-c", ContextFirst));
    assert_eq!(f.svc.bypass(id), Err(KvError::WrongState { session: id, state: Allocated, op: "bypass" }));
    assert_eq!(f.state(id), Allocated);
    // Unspecified disposition means required.
    let id2 =
        f.allocate(&AllocateRequest { disposition: KvTransferDisposition::Unspecified, ..request("bp-d", Concurrent) });
    assert_eq!(f.svc.bypass(id2), Err(KvError::WrongState { session: id2, state: Allocated, op: "bypass" }));
    // A consumer that can go on neither way fails cleanly.
    let s = f.svc.fail(id, "no local state").unwrap();
    assert_eq!((s.state, s.reason.as_deref()), (Failed, Some("no local state")));
    f.svc.release(id2).unwrap();
    // Decode without any session: only under explicit bypass here.
    assert_eq!(f.svc.check_sessionless_decode(KvTransferDisposition::Bypass), Ok(()));
    assert_eq!(f.svc.check_sessionless_decode(KvTransferDisposition::Required), Err(KvError::SessionRequired));
    f.finish();
}

/// Flow 5: either participant rejects (also after KV was pinned) or fails
/// the session; a failed transfer fails it; release stays idempotent; the
/// lease reclaims what nobody cleans up.
#[test]
fn flow_rejection_and_failure_by_either_participant() {
    let f = Fixture::new();
    // The consumer rejects after the producer pinned its KV.
    let a = f.ready(&request("rj-a", ContextFirst));
    f.attach(a);
    let s = f.svc.reject(a, "decode pool full").unwrap();
    assert_eq!((s.state, s.reason.as_deref()), (Rejected, Some("decode pool full")));
    assert_eq!(f.pinned(), 0, "rejection frees the pinned KV");
    assert_eq!(f.svc.release(a).unwrap(), s, "release after rejection is a no-op");
    assert_eq!(f.svc.abort(a).unwrap(), s, "abort after rejection is a no-op");
    // The producer rejects before computing anything.
    let b = f.allocate(&request("rj-b", GenerationFirst));
    assert!(matches!(f.svc.attach(b, &meta()), Ok(AttachOutcome::Queued(_))));
    let s = f.svc.reject(b, "prefill refused").unwrap();
    assert_eq!((s.state, s.consumer_queued), (Rejected, false));
    // A participant reports a failure.
    let c = f.ready(&request("rj-c", ContextFirst));
    assert_eq!(f.svc.fail(c, "prefill worker crashed").unwrap().state, Failed);
    assert_eq!(f.pinned(), 0);
    assert_eq!(f.svc.release(c).unwrap().state, Failed);
    // A transfer of the session that fails fails it at the next poll.
    let d = f.ready(&request("rj-d", ContextFirst));
    f.attach(d);
    f.e.fault_hooks().push(FaultDirective::Fail { bytes: 100, effect_unknown: false });
    f.track(d, f.read());
    assert!(f.e.wait_idle(WAIT));
    assert_eq!(f.state(d), Attached, "nothing happens before the timer runs");
    assert_eq!(f.svc.poll(), 0);
    let s = f.svc.get(d).unwrap();
    assert_eq!(s.state, Failed);
    assert!(s.reason.as_deref().is_some_and(|r| r.contains("Failed")), "{s:?}");
    assert_eq!((f.pinned(), f.e.stats().prepared_transfers), (0, 0));
    // Orphaned: neither side cleans up; the lease reclaims it.
    let e = f.ready(&AllocateRequest { lease_ms: Some(500), ..request("rj-e", ContextFirst) });
    f.clock.advance(500);
    f.svc.poll();
    let s = f.svc.get(e).unwrap();
    assert_eq!((s.state, s.reason.as_deref()), (Expired, Some("lease expired")));
    f.finish();
}

/// The producer marks ready while the consumer releases or aborts the same
/// session, on two threads. Whichever wins, once both calls returned the
/// session is ended and nothing it pinned stays pinned.
#[test]
fn racing_mark_ready_against_release_or_abort_never_leaks_a_pin() {
    let f = Fixture::new();
    for round in 0..200 {
        let id = f.allocate(&request(&format!("race-end-{round}"), Concurrent));
        let start = Barrier::new(2);
        let (ready, ended) = std::thread::scope(|s| {
            let producer = s.spawn(|| {
                start.wait();
                f.svc.mark_ready(id, &f.kv_ranges(), &meta())
            });
            let consumer = s.spawn(|| {
                start.wait();
                if round % 2 == 0 { f.svc.release(id) } else { f.svc.abort(id) }
            });
            (producer.join().unwrap(), consumer.join().unwrap().unwrap())
        });
        assert!(matches!(ended.state, Released | Cancelled), "{ended:?}");
        match ready {
            Ok(s) => assert_eq!(s.state, Ready, "round {round}"),
            Err(e) => assert_eq!(e, KvError::Terminal { session: id, state: ended.state }, "round {round}"),
        }
        assert_eq!(f.state(id), ended.state);
        assert_eq!(f.pinned(), 0, "round {round}: a pin outlived its session");
    }
    f.finish();
}

// ---------------------------------------------------------------------------
// Abort and release with work in flight.

/// A session ends while its transfer is held mid-flight: the pin and the
/// producer's (deregistered, so fenced) registration stay until the
/// transfer retired and the timer saw it; then everything goes at once.
fn end_with_a_transfer_in_flight(abort_first: bool) {
    let mut f = Fixture::new();
    let id = f.ready(&request("held", ContextFirst));
    f.attach(id);
    f.e.fault_hooks().hold_all(true);
    f.track(id, f.read());
    assert!(f.e.fault_hooks().wait_held(1, WAIT));
    // The producer deregisters its KV while the session pins it.
    f.deregister_kv();
    let held = f.e.stats();
    assert_eq!(
        (held.pinned_ranges, held.fenced_registrations, held.executions, held.prepared_transfers),
        (2, 1, 1, 1),
        "{held:?}"
    );
    let (first, second, state) = if abort_first {
        (f.svc.abort(id).unwrap(), f.svc.release(id).unwrap(), Cancelled)
    } else {
        (f.svc.release(id).unwrap(), f.svc.abort(id).unwrap(), Released)
    };
    assert_eq!(first.state, state);
    assert_eq!(second, first, "the second of abort/release changes nothing");
    // The timer runs (and time passes) while the task is held: nothing is
    // freed, the state stays.
    for _ in 0..3 {
        f.clock.advance(1000);
        assert_eq!(f.svc.poll(), 0);
        assert_eq!(f.e.stats(), held, "freed while a transfer still runs");
        assert_eq!(f.svc.get(id).unwrap(), first);
    }
    assert!(!f.svc.is_drained());
    f.e.fault_hooks().hold_all(false);
    f.e.fault_hooks().release_all();
    assert!(f.e.wait_idle(WAIT));
    assert_eq!(f.pinned(), 2, "retired, but freed only by the timer");
    f.svc.poll();
    let s = f.e.stats();
    assert_eq!(
        (s.pinned_ranges, s.fenced_registrations, s.executions, s.prepared_transfers, s.registrations),
        (0, 0, 0, 0, 1),
        "{s:?}"
    );
    assert_eq!(f.svc.get(id).unwrap(), first, "a terminal state never changes");
    // Polling again frees nothing twice.
    f.svc.poll();
    assert_eq!(f.e.stats(), s);
    f.finish();
}

#[test]
fn abort_then_release_with_a_transfer_in_flight_frees_only_after_retirement() {
    end_with_a_transfer_in_flight(true);
}

#[test]
fn release_then_abort_with_a_transfer_in_flight_frees_only_after_retirement() {
    end_with_a_transfer_in_flight(false);
}

/// Abort mid-transfer: the queued tasks never start, the running one
/// drains, the pin and transfer are freed only after that.
#[test]
fn cancellation_mid_transfer_stops_queued_tasks_and_frees_after_the_running_one_drains() {
    const LEN: u64 = 1 << 20;
    let f = Fixture::with(
        r#"{"task_bytes": 65536, "local_route_workers": 1, "max_tasks_in_flight": 1}"#,
        KvConnectorInfo::default(),
        LEN as usize,
    );
    let m = KvTransferMeta { layout: LAYOUT.into(), block_bytes: 65536, blocks: 16 };
    let id = f.allocate(&AllocateRequest { meta: m.clone(), ..request("mid", ContextFirst) });
    let kv = [Desc::new(f.kv.id, 0, LEN)];
    f.svc.mark_ready(id, &kv, &m).unwrap();
    assert!(matches!(f.svc.attach(id, &m), Ok(AttachOutcome::Attached(_))));
    f.e.fault_hooks().hold_all(true);
    let l = [Desc::new(f.dst.id, 0, LEN)];
    let t = f.e.prepare(&spec(Op::Read, &l, &kv)).unwrap();
    assert_eq!(t.shape().1, 16);
    t.post().unwrap();
    let Ok(tracked) = f.svc.track_transfer(id, t) else { panic!("track_transfer refused") };
    assert!(f.e.fault_hooks().wait_held(1, WAIT));
    let s = f.svc.abort(id).unwrap();
    assert_eq!((s.state, s.reason.as_deref()), (Cancelled, Some("aborted")));
    f.svc.poll();
    let st = f.e.stats();
    assert_eq!((st.pinned_ranges, st.executions, st.tasks_in_flight), (1, 1, 1), "{st:?}");
    // Still holding every task: were the queued ones not cancelled, the
    // next would be held now and the engine would never go idle.
    f.e.fault_hooks().release_all();
    assert!(f.e.wait_idle(WAIT), "queued tasks were not cancelled");
    assert!(f.e.fault_hooks().held().is_empty());
    f.e.fault_hooks().hold_all(false);
    let got = snapshot(&f.dst.mem);
    assert_eq!(got[..65536], snapshot(&f.kv.mem)[..65536], "the running task drained");
    assert!(got[65536..].iter().all(|b| *b == 0), "a cancelled task wrote bytes");
    let TransferStatus::Retired(r) = tracked.status() else { panic!("not retired") };
    assert_eq!((r.receipt.tasks_started, r.receipt.tasks_never_started), (1, 15), "the receipt");
    assert_eq!(r.outcome.code, OutcomeCode::Cancelled);
    drop(tracked);
    assert_eq!(f.pinned(), 1);
    f.svc.poll();
    assert_eq!((f.pinned(), f.e.stats().prepared_transfers), (0, 0));
    assert_eq!(f.state(id), Cancelled, "the drained transfer's outcome does not change the state");
    f.finish();
}

/// Peer loss in a real two-process transfer: the peer is killed while its
/// server holds the session's transfer; the timer fails the session and
/// frees everything. `Read`: this engine's consumer pulls the KV from the
/// producer process, its landing blocks pinned by the session, and the
/// producer dies. `Write`: this engine's producer pushes its pinned KV to
/// the consumer process, which dies.
fn peer_lost_mid_transfer(op: Op) {
    const LEN: u64 = 1 << 20;
    let mut p = PeerProcess::spawn();
    let f = Fixture::with(
        r#"{"listen": "127.0.0.1:0", "task_bytes": 262144, "peer_timeout_ms": 30000, "route": "tcp"}"#,
        KvConnectorInfo::default(),
        LEN as usize,
    );
    let seg = p.open(&f.e);
    let m = KvTransferMeta { layout: LAYOUT.into(), block_bytes: 262144, blocks: 4 };
    let id = f.allocate(&AllocateRequest { meta: m.clone(), ..request("peer", GenerationFirst) });
    let s = f.svc.get(id).unwrap();
    assert_eq!((s.rendezvous.endpoint, s.rendezvous.epoch), (f.e.endpoint().unwrap(), f.e.source_epoch()));
    let local = [Desc::new(f.kv.id, 0, LEN)];
    f.svc.mark_ready(id, &local, &m).unwrap();
    assert!(matches!(f.svc.attach(id, &m), Ok(AttachOutcome::Attached(_))));
    assert_eq!(p.ask("hold on"), "OK");
    let remote = [Desc::new(p.region, 0, LEN)];
    let t = f.e.prepare(&TransferSpec::new(op, &local, &remote, Target::Peer(&seg))).unwrap();
    assert_eq!(t.route().route, Route::Tcp);
    t.post().unwrap();
    f.track(id, t);
    assert_eq!(f.svc.poll(), 1, "held by the peer: in flight");
    let st = f.e.stats();
    assert_eq!((st.pinned_ranges, st.executions, st.prepared_transfers), (1, 1, 1), "{st:?}");
    p.kill();
    poll_until(&f.svc, "the session to fail", || f.svc.get(id).unwrap().state == Failed);
    let s = f.svc.get(id).unwrap();
    assert!(s.reason.as_deref().is_some_and(|r| r.contains("Failed")), "{s:?}");
    assert!(seg.lost().is_some());
    let st = f.e.stats();
    assert_eq!((st.pinned_ranges, st.executions, st.prepared_transfers), (0, 0, 0), "{st:?}");
    assert_eq!(f.svc.release(id).unwrap(), s);
    assert_eq!(f.svc.abort(id).unwrap(), s);
    f.e.close_segment(&seg, WAIT).unwrap();
    drop(seg);
    f.finish();
}

#[test]
fn peer_loss_mid_transfer_producer_killed_fails_the_session_and_frees_everything() {
    peer_lost_mid_transfer(Op::Read);
}

#[test]
fn peer_loss_mid_transfer_consumer_killed_fails_the_session_and_frees_everything() {
    peer_lost_mid_transfer(Op::Write);
}

// ---------------------------------------------------------------------------
// Leases and drain.

/// A queued consumer that stops renewing: the lease expires and reclaims the
/// producer's pinned KV (and a session no producer ever filled).
#[test]
fn lease_expiry_while_queued_reclaims_the_producers_pinned_kv() {
    let f = Fixture::new();
    let lease = |key| AllocateRequest { lease_ms: Some(1000), ..request(key, GenerationFirst) };
    let a = f.allocate(&lease("exp-a"));
    let b = f.allocate(&lease("exp-b"));
    for id in [a, b] {
        match f.svc.attach(id, &meta()).unwrap() {
            AttachOutcome::Queued(s) => assert_eq!(s.lease_expires_at_ms, 1000),
            other => panic!("{other:?}"),
        }
    }
    f.clock.advance(400);
    let s = f.svc.mark_ready(b, &f.kv_ranges(), &meta()).unwrap();
    assert_eq!((s.state, s.consumer_queued), (Ready, true));
    f.clock.advance(599);
    assert_eq!(f.svc.poll(), 2);
    assert_eq!(f.pinned(), 2);
    f.clock.advance(1);
    assert_eq!(f.svc.poll(), 0, "both leases ran out at 1000 ms");
    for id in [a, b] {
        let s = f.svc.get(id).unwrap();
        assert_eq!((s.state, s.consumer_queued, s.reason.as_deref()), (Expired, false, Some("lease expired")));
        assert_eq!(f.svc.attach(id, &meta()), Err(KvError::Terminal { session: id, state: Expired }));
        assert_eq!(f.svc.renew(id, None), Err(KvError::Terminal { session: id, state: Expired }));
    }
    assert_eq!(f.pinned(), 0, "the producer's KV was reclaimed");
    f.finish();
}

/// A queued consumer renewing keeps the session (and its producer) alive
/// far beyond the first lease; a twin that does not renew expires.
#[test]
fn renewal_keeps_a_queued_consumer_alive() {
    let f = Fixture::new();
    let lease = |key| AllocateRequest { lease_ms: Some(1000), ..request(key, GenerationFirst) };
    let id = f.allocate(&lease("renewed"));
    let twin = f.allocate(&lease("not-renewed"));
    assert!(matches!(f.svc.attach(id, &meta()), Ok(AttachOutcome::Queued(_))));
    assert!(matches!(f.svc.attach(twin, &meta()), Ok(AttachOutcome::Queued(_))));
    for i in 1..=5u64 {
        f.clock.advance(900);
        let s = f.svc.renew(id, Some(1000)).unwrap();
        assert_eq!((s.state, s.consumer_queued, s.lease_expires_at_ms), (Allocated, true, 900 * i + 1000));
        f.svc.poll();
        assert_eq!(f.svc.get(id).unwrap(), s, "renewed: still queued");
        if i == 2 {
            assert_eq!(f.state(twin), Expired);
        }
    }
    // 4.5 s in, far past the first lease: the default lease renews too.
    let s = f.svc.renew(id, None).unwrap();
    assert_eq!(s.lease_expires_at_ms, 4500 + f.svc.info().default_lease_ms);
    f.svc.mark_ready(id, &f.kv_ranges(), &meta()).unwrap();
    assert_eq!(f.attach(id).state, Attached);
    // Renewal works in every live state, attached included.
    f.clock.advance(100);
    assert_eq!(f.svc.renew(id, Some(1000)).unwrap().lease_expires_at_ms, 5600);
    assert_eq!(f.svc.complete(id).unwrap().state, Complete);
    assert_eq!(f.svc.renew(id, Some(1000)), Err(KvError::Terminal { session: id, state: Complete }));
    f.finish();
}

/// Drain refuses new sessions (identical retries still get theirs), counts
/// the live ones, and is drained once every session ended and was freed.
#[test]
fn drain_refuses_new_sessions_keeps_retries_and_ends_with_nothing_live() {
    let f = Fixture::new();
    let (ra, rb, rc) = (request("dr-a", ContextFirst), request("dr-b", ContextFirst), request("dr-c", Concurrent));
    let a = f.ready(&ra);
    f.attach(a);
    f.e.fault_hooks().hold_all(true);
    f.track(a, f.read());
    assert!(f.e.fault_hooks().wait_held(1, WAIT));
    let b = f.ready(&rb);
    let c = f.allocate(&rc);
    assert_eq!(f.svc.live_count(), 3);
    assert!(!f.svc.is_drained(), "not draining yet");
    f.svc.start_drain();
    let before = f.e.stats();
    assert_eq!(f.svc.allocate(&request("dr-new", ContextFirst)), Err(KvError::Draining));
    assert_eq!(f.svc.allocate(&rc).unwrap().session_id, c, "an identical retry gets its session");
    assert_eq!(
        f.svc.allocate(&AllocateRequest { model: "other".into(), ..rc.clone() }),
        Err(KvError::IdempotencyConflict { key: "dr-c".into(), session: c })
    );
    assert_eq!((f.svc.live_count(), f.e.stats()), (3, before));
    assert!(!f.svc.is_drained());
    // Existing sessions go on normally.
    assert!(matches!(f.svc.attach(c, &meta()), Ok(AttachOutcome::Queued(_))));
    f.svc.mark_ready(c, &f.kv_ranges(), &meta()).unwrap();
    f.attach(c);
    assert_eq!(f.svc.complete(c).unwrap().state, Complete);
    assert_eq!(f.svc.live_count(), 2);
    f.svc.release(b).unwrap();
    f.svc.abort(a).unwrap();
    assert_eq!(f.svc.live_count(), 0);
    f.svc.poll();
    assert!(!f.svc.is_drained(), "a transfer still runs, its session's KV is still pinned");
    assert_eq!(f.pinned(), 2);
    f.e.fault_hooks().hold_all(false);
    f.e.fault_hooks().release_all();
    assert!(f.e.wait_idle(WAIT));
    f.svc.poll();
    assert!(f.svc.is_drained());
    assert_eq!((f.svc.live_count(), f.pinned()), (0, 0));
    assert_eq!(f.svc.allocate(&request("dr-late", ContextFirst)), Err(KvError::Draining));
    f.finish();
}

// ---------------------------------------------------------------------------
// Presence, defaults and validation.

#[test]
fn validation_request_id_model_and_idempotency_key_are_required() {
    let f = Fixture::new();
    let before = f.e.stats();
    let base = request("v-req", ContextFirst);
    let cases: [(&str, AllocateRequest); 4] = [
        ("request_id", AllocateRequest { request_id: String::new(), ..base.clone() }),
        ("model", AllocateRequest { model: String::new(), ..base.clone() }),
        ("idempotency_key", AllocateRequest { idempotency_key: String::new(), ..base.clone() }),
        ("meta.layout", AllocateRequest { meta: KvTransferMeta { layout: String::new(), ..meta() }, ..base.clone() }),
    ];
    for (field, req) in cases {
        assert_eq!(f.svc.allocate(&req), Err(KvError::MissingField(field)));
    }
    for bad in [
        KvTransferMeta { block_bytes: 0, ..meta() },
        KvTransferMeta { blocks: 0, ..meta() },
        KvTransferMeta { block_bytes: u64::MAX, blocks: 2, ..meta() },
    ] {
        let got = f.svc.allocate(&AllocateRequest { meta: bad.clone(), ..base.clone() });
        assert!(matches!(got, Err(KvError::IncompatibleMetadata(_))), "{bad:?}: {got:?}");
    }
    assert_eq!((f.svc.live_count(), f.e.stats()), (0, before));
    // Nothing was allocated, not even an id; the key is still free.
    assert_eq!(f.allocate(&base), f.sid(1));
    f.svc.release(f.sid(1)).unwrap();
    f.finish();
}

#[test]
fn validation_identical_retry_returns_the_session_and_conflicting_reuse_fails() {
    let f = Fixture::new();
    let req = request("v-idem", ContextFirst);
    let s = f.svc.allocate(&req).unwrap();
    let id = s.session_id;
    assert_eq!(f.svc.allocate(&req).unwrap(), s);
    // A retry reports the session as it stands now.
    f.svc.mark_ready(id, &f.kv_ranges(), &meta()).unwrap();
    let now = f.svc.allocate(&req).unwrap();
    assert_eq!((now.session_id, now.state), (id, Ready));
    assert_eq!(f.pinned(), 2, "a retry pins nothing more");
    let conflicts = [
        AllocateRequest { request_id: "other".into(), ..req.clone() },
        AllocateRequest { model: "other".into(), ..req.clone() },
        AllocateRequest { style: GenerationFirst, ..req.clone() },
        AllocateRequest { style: Unspecified, ..req.clone() },
        AllocateRequest { disposition: KvTransferDisposition::Bypass, ..req.clone() },
        AllocateRequest { disposition: KvTransferDisposition::Unspecified, ..req.clone() },
        AllocateRequest { lease_ms: Some(LEASE + 1), ..req.clone() },
        AllocateRequest { lease_ms: None, ..req.clone() },
        AllocateRequest { meta: KvTransferMeta { blocks: BLOCKS + 1, ..meta() }, ..req.clone() },
        AllocateRequest { meta: KvTransferMeta { layout: "other".into(), ..meta() }, ..req.clone() },
    ];
    let before = f.e.stats();
    for c in &conflicts {
        assert_eq!(f.svc.allocate(c), Err(KvError::IdempotencyConflict { key: "v-idem".into(), session: id }), "{c:?}");
    }
    assert_eq!((f.svc.live_count(), f.e.stats(), f.state(id)), (1, before, Ready));
    // Another key is another session.
    let other = f.allocate(&request("v-idem-2", ContextFirst));
    assert_ne!(other, id);
    // After the session ended, a retry returns its tombstone: no new session.
    let released = f.svc.release(id).unwrap();
    assert_eq!(f.svc.allocate(&req).unwrap(), released);
    assert_eq!(f.svc.live_count(), 1);
    f.svc.release(other).unwrap();
    f.finish();
}

#[test]
fn validation_unspecified_style_gets_the_default_without_claiming_support() {
    let f = Fixture::new();
    let default = f.svc.info().default_style;
    assert_eq!(default, ContextFirst);
    let s = f.svc.allocate(&request("v-style", Unspecified)).unwrap();
    assert_eq!((s.style, s.effective_style), (Unspecified, ContextFirst), "the request is reported as made");
    assert_eq!(f.svc.get(s.session_id).unwrap().style, Unspecified);
    // The default applies: context-first does not queue.
    assert_eq!(f.svc.attach(s.session_id, &meta()), Err(KvError::NotReady(s.session_id)));
    f.svc.release(s.session_id).unwrap();
    f.finish();
    // Another default: generation-first queues.
    let f = Fixture::info(KvConnectorInfo { default_style: GenerationFirst, ..KvConnectorInfo::default() });
    let s = f.svc.allocate(&request("v-style", Unspecified)).unwrap();
    assert_eq!((s.style, s.effective_style), (Unspecified, GenerationFirst));
    assert!(matches!(f.svc.attach(s.session_id, &meta()), Ok(AttachOutcome::Queued(_))));
    f.svc.release(s.session_id).unwrap();
    f.finish();
}

#[test]
fn validation_unsupported_explicit_style_fails_before_allocation() {
    let f = Fixture::info(KvConnectorInfo {
        supported_styles: vec![ContextFirst],
        default_style: ContextFirst,
        ..KvConnectorInfo::default()
    });
    assert_eq!(f.svc.info().supported_styles, vec![ContextFirst]);
    let before = f.e.stats();
    for style in [GenerationFirst, Concurrent] {
        assert_eq!(f.svc.allocate(&request("v-uns", style)), Err(KvError::UnsupportedStyle(style)));
    }
    assert_eq!((f.svc.live_count(), f.e.stats()), (0, before));
    // Nothing was allocated: the first session gets the first id, and the
    // key is free for a supported style.
    let s = f.svc.allocate(&request("v-uns", Unspecified)).unwrap();
    assert_eq!((s.session_id, s.effective_style), (f.sid(1), ContextFirst));
    assert_eq!(f.allocate(&request("v-uns-2", ContextFirst)), f.sid(2));
    f.svc.release(f.sid(1)).unwrap();
    f.svc.release(f.sid(2)).unwrap();
    f.finish();
}

#[test]
fn validation_switched_off_capabilities_are_refused_and_change_nothing() {
    let f =
        Fixture::info(KvConnectorInfo { explicit_release: false, session_lookup: false, ..KvConnectorInfo::default() });
    let s = f.svc.allocate(&request("v-caps", ContextFirst)).unwrap();
    let before = f.e.stats();
    assert_eq!(f.svc.get(s.session_id), Err(KvError::CapabilityOff("session_lookup")));
    assert_eq!(f.svc.release(s.session_id), Err(KvError::CapabilityOff("explicit_release")));
    assert_eq!(f.svc.release(f.sid(99)), Err(KvError::CapabilityOff("explicit_release")), "checked first");
    assert_eq!((f.svc.live_count(), f.e.stats()), (1, before), "nothing changed");
    assert_eq!(f.svc.abort(s.session_id).unwrap().state, KvSessionState::Cancelled, "it was still live");
    f.finish();
    let e = KvError::CapabilityOff("explicit_release");
    assert_eq!((e.status().reason, e.metadata()), ("CAPABILITY_OFF", vec![("capability", "explicit_release".into())]));

    let g = Fixture::info(KvConnectorInfo { caller_allocation: false, ..KvConnectorInfo::default() });
    let before = g.e.stats();
    assert_eq!(g.svc.allocate(&request("v-caps", ContextFirst)), Err(KvError::CapabilityOff("caller_allocation")));
    let no_key = AllocateRequest { idempotency_key: String::new(), ..request("v-caps", ContextFirst) };
    assert_eq!(g.svc.allocate(&no_key), Err(KvError::CapabilityOff("caller_allocation")), "before the fields");
    assert_eq!((g.svc.live_count(), g.e.stats()), (0, before));
    g.finish();
}

#[test]
fn validation_absent_lease_gets_the_advertised_default_as_an_absolute_expiry() {
    let f = Fixture::info(KvConnectorInfo { default_lease_ms: 2500, ..KvConnectorInfo::default() });
    assert_eq!(f.svc.info().default_lease_ms, 2500);
    f.clock.advance(7000);
    let a = f.svc.allocate(&AllocateRequest { lease_ms: None, ..request("v-lease-a", ContextFirst) }).unwrap();
    assert_eq!(a.lease_expires_at_ms, 9500, "absolute: now + the advertised default");
    let b = f.svc.allocate(&AllocateRequest { lease_ms: Some(100), ..request("v-lease-b", ContextFirst) }).unwrap();
    assert_eq!(b.lease_expires_at_ms, 7100);
    f.clock.advance(100);
    assert_eq!(f.svc.poll(), 1);
    assert_eq!((f.state(a.session_id), f.state(b.session_id)), (Allocated, Expired));
    f.clock.advance(2399);
    assert_eq!(f.svc.poll(), 1);
    f.clock.advance(1);
    assert_eq!(f.svc.poll(), 0, "absence never means immortal");
    assert_eq!(f.state(a.session_id), Expired);
    f.finish();
}

#[test]
fn validation_zero_negative_and_overlong_leases_are_invalid() {
    let f = Fixture::new();
    let max = f.svc.info().max_lease_ms;
    let before = f.e.stats();
    let with = |lease| AllocateRequest { lease_ms: Some(lease), ..request("v-bad-lease", ContextFirst) };
    for bad in [0, -1, -30_000, i64::MIN] {
        assert_eq!(f.svc.allocate(&with(bad)), Err(KvError::InvalidLease(bad)));
    }
    for long in [max as i64 + 1, i64::MAX] {
        assert_eq!(f.svc.allocate(&with(long)), Err(KvError::LeaseTooLong { requested: long, max }));
    }
    assert_eq!((f.svc.live_count(), f.e.stats()), (0, before));
    let s = f.svc.allocate(&with(max as i64)).unwrap();
    assert_eq!(s.lease_expires_at_ms, max);
    // Renewal validates the same way and changes nothing when refused.
    let id = s.session_id;
    f.clock.advance(10);
    for bad in [0, -1, i64::MIN] {
        assert_eq!(f.svc.renew(id, Some(bad)), Err(KvError::InvalidLease(bad)));
    }
    assert_eq!(f.svc.renew(id, Some(max as i64 + 1)), Err(KvError::LeaseTooLong { requested: max as i64 + 1, max }));
    assert_eq!(f.svc.get(id).unwrap(), s);
    assert_eq!(f.svc.renew(id, Some(1)).unwrap().lease_expires_at_ms, 11);
    f.clock.advance(1);
    f.svc.poll();
    assert_eq!(f.state(id), Expired);
    f.finish();
}

/// Every session, in every live state and whatever its lease, has a finite
/// expiry and expires when the clock reaches it without renewal (also where
/// leases cannot be renewed at all).
#[test]
fn validation_nothing_is_immortal() {
    for renewable in [true, false] {
        let f = Fixture::info(KvConnectorInfo { renewable_leases: renewable, ..KvConnectorInfo::default() });
        let info = f.svc.info();
        let max = info.max_lease_ms;
        let mut ids = Vec::new();
        for (i, lease) in [None, Some(max as i64)].into_iter().enumerate() {
            let req = |k: &str| AllocateRequest { lease_ms: lease, ..request(&format!("{k}-{i}"), GenerationFirst) };
            let allocated = f.allocate(&req("allocated"));
            let queued = f.allocate(&req("queued"));
            assert!(matches!(f.svc.attach(queued, &meta()), Ok(AttachOutcome::Queued(_))));
            let ready = f.ready(&req("ready"));
            let attached = f.ready(&req("attached"));
            f.attach(attached);
            ids.extend([allocated, queued, ready, attached]);
        }
        for &id in &ids {
            let s = f.svc.get(id).unwrap();
            assert!(s.lease_expires_at_ms <= max, "{s:?}");
        }
        if !renewable {
            let state = f.state(ids[0]);
            assert_eq!(f.svc.renew(ids[0], None), Err(KvError::WrongState { session: ids[0], state, op: "renew" }));
        }
        assert_eq!(f.pinned(), 8);
        f.clock.advance(info.default_lease_ms - 1);
        assert_eq!(f.svc.poll(), 8);
        f.clock.advance(1);
        assert_eq!(f.svc.poll(), 4, "the default leases ran out");
        for &id in &ids[..4] {
            assert_eq!(f.state(id), Expired);
        }
        assert_eq!(f.pinned(), 4);
        f.clock.advance(max - info.default_lease_ms - 1);
        assert_eq!(f.svc.poll(), 4);
        f.clock.advance(1);
        assert_eq!(f.svc.poll(), 0, "the longest lease ran out");
        for &id in &ids[4..] {
            assert_eq!(f.state(id), Expired);
        }
        assert_eq!(f.pinned(), 0);
        f.finish();
    }
}

/// Release is idempotent; the tombstone answers get (and retries) for the
/// advertised retention, then the session is gone: NotFound everywhere.
/// Session id 0 is never a session.
#[test]
fn validation_release_is_idempotent_and_tombstones_stay_queryable_for_their_retention() {
    let f = Fixture::info(KvConnectorInfo { tombstone_retention_ms: 10_000, ..KvConnectorInfo::default() });
    let id = f.ready(&request("v-tomb", ContextFirst));
    let s = f.svc.release(id).unwrap();
    assert_eq!((s.state, f.pinned()), (Released, 0));
    assert_eq!(f.svc.release(id).unwrap(), s);
    assert_eq!(f.svc.abort(id).unwrap(), s);
    assert_eq!(f.svc.get(id).unwrap(), s);
    f.clock.advance(9_999);
    f.svc.poll();
    assert_eq!(f.svc.get(id).unwrap(), s, "within its retention");
    assert_eq!(f.svc.release(id).unwrap(), s, "a retried release is still answered");
    f.clock.advance(1);
    assert_eq!(f.svc.get(id), Err(KvError::NotFound(id)), "retention over (even before the timer ran)");
    f.svc.poll();
    assert_eq!(f.svc.get(id), Err(KvError::NotFound(id)));
    assert_eq!(f.svc.release(id), Err(KvError::NotFound(id)));
    assert_eq!(f.svc.abort(id), Err(KvError::NotFound(id)));
    assert_eq!(f.svc.renew(id, None), Err(KvError::NotFound(id)));
    assert_eq!(f.svc.attach(id, &meta()), Err(KvError::NotFound(id)));
    assert_eq!(f.svc.mark_ready(id, &f.kv_ranges(), &meta()), Err(KvError::NotFound(id)));
    assert_eq!(f.pinned(), 0);
    for op in [
        f.svc.get(f.sid(0)).map(|_| ()),
        f.svc.renew(f.sid(0), None).map(|_| ()),
        f.svc.release(f.sid(0)).map(|_| ()),
        f.svc.abort(f.sid(0)).map(|_| ()),
    ] {
        assert_eq!(op, Err(KvError::NotFound(f.sid(0))), "session id 0 is never a session");
    }
    // An id of another incarnation (a restarted service) is never one of
    // this service's sessions, whatever its sequence.
    let live = f.allocate(&request("v-other-inc", ContextFirst));
    let other = SessionId { incarnation: live.incarnation ^ 0x10, seq: live.seq };
    for op in [
        f.svc.get(other).map(|_| ()),
        f.svc.renew(other, None).map(|_| ()),
        f.svc.release(other).map(|_| ()),
        f.svc.abort(other).map(|_| ()),
        f.svc.attach(other, &meta()).map(|_| ()),
        f.svc.mark_ready(other, &f.kv_ranges(), &meta()).map(|_| ()),
    ] {
        assert_eq!(
            op,
            Err(KvError::OtherIncarnation { session: other.to_string(), incarnation: live.incarnation }),
            "another incarnation's id"
        );
    }
    assert_eq!(f.state(live), Allocated);
    assert_eq!(f.pinned(), 0);
    f.svc.release(live).unwrap();
    f.finish();
}

#[test]
fn validation_tombstones_are_bounded() {
    let f = Fixture::info(KvConnectorInfo { max_tombstones: 2, ..KvConnectorInfo::default() });
    let ids: Vec<SessionId> = (0..4).map(|i| f.allocate(&request(&format!("v-bound-{i}"), ContextFirst))).collect();
    for &id in &ids[..3] {
        f.svc.release(id).unwrap();
    }
    f.svc.poll();
    assert_eq!(f.svc.get(ids[0]), Err(KvError::NotFound(ids[0])), "the oldest tombstone beyond the bound");
    assert_eq!((f.state(ids[1]), f.state(ids[2]), f.state(ids[3])), (Released, Released, Allocated));
    f.svc.reject(ids[3], "no").unwrap();
    f.svc.poll();
    assert_eq!(f.svc.get(ids[1]), Err(KvError::NotFound(ids[1])));
    assert_eq!((f.state(ids[2]), f.state(ids[3])), (Released, Rejected));
    f.finish();
}

#[test]
fn validation_sessionless_decode_needs_explicit_bypass_or_local_prefill() {
    use KvTransferDisposition as D;
    let all = [D::Unspecified, D::Required, D::Bypass];
    let cases: [(bool, bool, [bool; 3]); 4] = [
        // (conditional_bypass, local_prefill) -> allowed for each disposition
        (true, false, [false, false, true]),
        (false, false, [false, false, false]),
        (false, true, [true, true, true]),
        (true, true, [true, true, true]),
    ];
    for (conditional_bypass, local_prefill, allowed) in cases {
        let f = Fixture::info(KvConnectorInfo { conditional_bypass, local_prefill, ..KvConnectorInfo::default() });
        for (d, ok) in all.into_iter().zip(allowed) {
            let got = f.svc.check_sessionless_decode(d);
            let want = if ok { Ok(()) } else { Err(KvError::SessionRequired) };
            assert_eq!(got, want, "bypass advertised {conditional_bypass}, local prefill {local_prefill}, {d:?}");
        }
        if !conditional_bypass {
            // Nor may a session ask to bypass where bypass is not advertised.
            assert_eq!(f.svc.allocate(&bypass_request("v-bp", Concurrent)), Err(KvError::BypassNotSupported));
            assert_eq!(f.svc.live_count(), 0);
        }
        f.finish();
    }
}

/// Every terminal state refuses every transition (abort and release are
/// no-ops returning the session), pins nothing, takes no transfer, and
/// stays as it is.
#[test]
fn validation_terminal_states_never_come_back() {
    let f = Fixture::new();
    let mut sessions = Vec::new();
    let id = f.ready(&request("t-complete", ContextFirst));
    f.attach(id);
    f.svc.complete(id).unwrap();
    sessions.push((id, Complete));
    let id = f.ready(&bypass_request("t-bypassed", ContextFirst));
    f.svc.bypass(id).unwrap();
    sessions.push((id, Bypassed));
    let id = f.ready(&request("t-rejected", ContextFirst));
    f.svc.reject(id, "no").unwrap();
    sessions.push((id, Rejected));
    let id = f.ready(&request("t-cancelled", ContextFirst));
    f.svc.abort(id).unwrap();
    sessions.push((id, Cancelled));
    let id = f.ready(&request("t-failed", ContextFirst));
    f.svc.fail(id, "crash").unwrap();
    sessions.push((id, Failed));
    let id = f.ready(&request("t-released", ContextFirst));
    f.svc.release(id).unwrap();
    sessions.push((id, Released));
    let id = f.ready(&AllocateRequest { lease_ms: Some(100), ..request("t-expired", GenerationFirst) });
    f.clock.advance(100);
    f.svc.poll();
    sessions.push((id, Expired));
    assert_eq!(f.pinned(), 0);
    for (id, state) in sessions {
        let s = f.svc.get(id).unwrap();
        assert_eq!(s.state, state);
        let before = f.e.stats();
        let terminal = Err(KvError::Terminal { session: id, state });
        assert_eq!(f.svc.mark_ready(id, &f.kv_ranges(), &meta()), terminal, "mark_ready on {state:?}");
        assert_eq!(f.svc.attach(id, &meta()).map(|_| ()), terminal.clone().map(|_: KvSession| ()));
        assert_eq!(f.svc.renew(id, None), terminal, "renew on {state:?}");
        assert_eq!(f.svc.renew(id, Some(1000)), terminal);
        assert_eq!(f.svc.complete(id), terminal, "complete on {state:?}");
        assert_eq!(f.svc.bypass(id), terminal, "bypass on {state:?}");
        assert_eq!(f.svc.reject(id, "again"), terminal, "reject on {state:?}");
        assert_eq!(f.svc.fail(id, "again"), terminal, "fail on {state:?}");
        assert_eq!(f.svc.abort(id).unwrap(), s, "abort on {state:?} is a no-op");
        assert_eq!(f.svc.release(id).unwrap(), s, "release on {state:?} is a no-op");
        let req = f.svc.get(id).map(|s| s.idempotency_key).unwrap();
        let retry = if req == "t-bypassed" {
            bypass_request(&req, ContextFirst)
        } else if req == "t-expired" {
            AllocateRequest { lease_ms: Some(100), ..request(&req, GenerationFirst) }
        } else {
            request(&req, ContextFirst)
        };
        assert_eq!(f.svc.allocate(&retry).unwrap(), s, "an identical retry returns the tombstone");
        match f.svc.track_transfer(id, f.read()) {
            Err((t, e)) => {
                assert_eq!(Err::<(), _>(e), terminal.clone().map(|_: KvSession| ()));
                wait_retired(&t);
            }
            Ok(_) => panic!("an ended session took a transfer"),
        }
        f.svc.poll();
        assert_eq!(f.svc.get(id).unwrap(), s, "{state:?} changed");
        assert_eq!(f.e.stats(), before, "a refused transition on {state:?} changed the engine's charges");
    }
    assert_eq!(f.svc.live_count(), 0);
    f.finish();
}

/// Transfer metadata that does not match the session's (layout, block size,
/// block count, or ranges whose total is not the session's KV) and ranges
/// the engine cannot pin are refused before any mutation: state, pins and
/// stats stay. Out-of-order transitions are refused the same way.
#[test]
fn validation_incompatible_metadata_is_rejected_before_any_mutation() {
    let f = Fixture::new();
    // A registration that is gone: the engine refuses to pin it.
    let gone = region(&f.e, 4096, Permission::RemoteReadWrite);
    f.e.deregister(gone.id).unwrap();
    let id = f.allocate(&request("v-meta", GenerationFirst));
    let s = f.svc.get(id).unwrap();
    let before = f.e.stats();
    let kv = f.kv.id;
    let wrong_meta = [
        KvTransferMeta { layout: "mistral-7b/bf16/16x128".into(), ..meta() },
        KvTransferMeta { block_bytes: BLOCK / 2, blocks: BLOCKS * 2, ..meta() }, // same bytes, other blocks
        KvTransferMeta { blocks: BLOCKS - 1, ..meta() },
        KvTransferMeta { block_bytes: BLOCK * 2, ..meta() },
    ];
    for m in &wrong_meta {
        let got = f.svc.mark_ready(id, &f.kv_ranges(), m);
        assert!(matches!(got, Err(KvError::IncompatibleMetadata(_))), "{m:?}: {got:?}");
        let got = f.svc.attach(id, m);
        assert!(matches!(got, Err(KvError::IncompatibleMetadata(_))), "{m:?}: {got:?}");
    }
    let wrong_ranges: [Vec<Desc>; 5] = [
        vec![Desc::new(kv, 0, 8192)],                                                 // short
        vec![Desc::new(kv, 0, 8192), Desc::new(kv, 16384, 8193)],                     // long
        vec![],                                                                       // none
        vec![Desc::new(kv, 0, 16384), Desc::new(kv, 16384, 0)],                       // an empty range
        vec![Desc::new(kv, 0, 8192), Desc::new(kv, 8192, 4096), Desc::new(kv, 0, 0)], // short, empty
    ];
    for r in &wrong_ranges {
        let got = f.svc.mark_ready(id, r, &meta());
        assert!(matches!(got, Err(KvError::IncompatibleMetadata(_))), "{r:?}: {got:?}");
    }
    let unpinnable: [Vec<Desc>; 2] = [
        vec![Desc::new(kv, 0, 8192), Desc::new(kv, KV as u64 - 4096, 8192)], // beyond the registration
        vec![Desc::new(kv, 0, 8192), Desc::new(gone.id, 0, 4096), Desc::new(kv, 8192, 4096)], // deregistered
    ];
    for r in &unpinnable {
        let got = f.svc.mark_ready(id, r, &meta());
        assert!(matches!(got, Err(KvError::Engine(_))), "{r:?}: {got:?}");
    }
    assert_eq!(f.svc.get(id).unwrap(), s, "a refused call changed the session");
    assert_eq!(f.e.stats(), before, "a refused call pinned or charged something");
    // Out of order: the consumer cannot complete before attaching.
    assert_eq!(f.svc.complete(id), Err(KvError::WrongState { session: id, state: Allocated, op: "complete" }));
    // Now ready: a second mark_ready, a mismatched attach, and complete
    // before attach change nothing either.
    f.svc.mark_ready(id, &f.kv_ranges(), &meta()).unwrap();
    let ready = f.svc.get(id).unwrap();
    let pinned = f.e.stats();
    assert_eq!(pinned.pinned_ranges, 2);
    assert_eq!(
        f.svc.mark_ready(id, &f.kv_ranges(), &meta()),
        Err(KvError::WrongState { session: id, state: Ready, op: "mark_ready" })
    );
    for m in &wrong_meta {
        assert!(matches!(f.svc.attach(id, m), Err(KvError::IncompatibleMetadata(_))));
    }
    assert_eq!(f.svc.complete(id), Err(KvError::WrongState { session: id, state: Ready, op: "complete" }));
    assert_eq!((f.svc.get(id).unwrap(), f.e.stats()), (ready, pinned));
    assert_eq!(f.attach(id).state, Attached);
    assert_eq!(
        f.svc.mark_ready(id, &f.kv_ranges(), &meta()),
        Err(KvError::WrongState { session: id, state: Attached, op: "mark_ready" })
    );
    assert_eq!(f.pinned(), 2);
    f.svc.release(id).unwrap();
    drop(gone);
    f.finish();
}

#[test]
fn validation_too_many_live_sessions() {
    let f = Fixture::info(KvConnectorInfo { max_live_sessions: 2, ..KvConnectorInfo::default() });
    let ra = request("v-many-a", ContextFirst);
    let a = f.allocate(&ra);
    let b = f.ready(&request("v-many-b", ContextFirst));
    let rc = request("v-many-c", ContextFirst);
    let before = f.e.stats();
    assert_eq!(f.svc.allocate(&rc), Err(KvError::TooManySessions { limit: 2 }));
    assert_eq!((f.svc.live_count(), f.e.stats()), (2, before));
    assert_eq!(f.svc.allocate(&ra).unwrap().session_id, a, "a retry is not a new session");
    // Ended sessions (tombstones, uncleaned ones too) do not count.
    f.svc.release(a).unwrap();
    let c = f.allocate(&rc);
    assert_eq!(c, f.sid(3), "the refused allocation took no id");
    assert_eq!(f.svc.live_count(), 2);
    f.svc.release(b).unwrap();
    f.svc.release(c).unwrap();
    f.finish();
}

/// A lease that ran out ends the session at the next call on it, whether or
/// not the timer came by: no late renewal (or any other transition)
/// revives it, and what it pinned is freed at once.
#[test]
fn a_due_lease_ends_the_session_at_any_transition_before_the_timer_runs() {
    type Op<'a> = Box<dyn Fn(&Fixture, SessionId) -> Result<KvSessionState, KvError> + 'a>;
    let ops: Vec<(&str, bool, Op)> = vec![
        ("renew", true, Box::new(|f, id| f.svc.renew(id, Some(LEASE)).map(|s| s.state))),
        ("renew (invalid lease)", true, Box::new(|f, id| f.svc.renew(id, Some(0)).map(|s| s.state))),
        ("attach", true, Box::new(|f, id| f.svc.attach(id, &meta()).map(|_| Attached))),
        ("complete", true, Box::new(|f, id| f.svc.complete(id).map(|s| s.state))),
        ("bypass", true, Box::new(|f, id| f.svc.bypass(id).map(|s| s.state))),
        ("reject", true, Box::new(|f, id| f.svc.reject(id, "late").map(|s| s.state))),
        ("fail", true, Box::new(|f, id| f.svc.fail(id, "late").map(|s| s.state))),
        ("abort", true, Box::new(|f, id| f.svc.abort(id).map(|s| s.state))),
        ("release", true, Box::new(|f, id| f.svc.release(id).map(|s| s.state))),
        (
            "track_transfer",
            true,
            Box::new(|f, id| match f.svc.track_transfer(id, f.read()) {
                Ok(_) => Ok(Attached),
                Err((t, e)) => {
                    wait_retired(&t);
                    Err(e)
                }
            }),
        ),
        ("mark_ready", false, Box::new(|f, id| f.svc.mark_ready(id, &f.kv_ranges(), &meta()).map(|s| s.state))),
    ];
    let f = Fixture::new();
    for (i, (name, pin_first, op)) in ops.iter().enumerate() {
        let req = AllocateRequest { lease_ms: Some(1000), ..bypass_request(&format!("due-{i}"), ContextFirst) };
        let id = if *pin_first {
            let id = f.ready(&req);
            f.attach(id);
            id
        } else {
            f.allocate(&req)
        };
        f.clock.advance(1000);
        let got = op(&f, id);
        let want = match *name {
            "abort" | "release" => Ok(Expired),
            _ => Err(KvError::Terminal { session: id, state: Expired }),
        };
        assert_eq!(got, want, "{name} on a session whose lease ran out");
        assert_eq!(f.pinned(), 0, "{name}: the expired session's pin was not freed at once");
        let s = f.svc.get(id).unwrap();
        assert_eq!((s.state, s.reason.as_deref()), (Expired, Some("lease expired")), "{name}");
        assert_eq!(f.svc.live_count(), 0, "{name}");
    }
    f.finish();
}

#[test]
fn text_fields_and_range_counts_above_the_limits_are_refused_before_anything_changes() {
    let f = Fixture::info(KvConnectorInfo { max_field_bytes: 24, max_ranges: 1, ..KvConnectorInfo::default() });
    let before = f.e.stats();
    let long = "x".repeat(25);
    let base = request("limits", ContextFirst);
    for (field, req) in [
        ("request_id", AllocateRequest { request_id: long.clone(), ..base.clone() }),
        ("model", AllocateRequest { model: long.clone(), ..base.clone() }),
        ("idempotency_key", AllocateRequest { idempotency_key: long.clone(), ..base.clone() }),
        ("meta.layout", AllocateRequest { meta: KvTransferMeta { layout: long.clone(), ..meta() }, ..base.clone() }),
    ] {
        assert_eq!(f.svc.allocate(&req), Err(KvError::FieldTooLong { field, len: 25, max: 24 }));
    }
    assert_eq!((f.svc.live_count(), f.e.stats()), (0, before));
    // Exactly at the limit is accepted.
    let ok = AllocateRequest { request_id: "y".repeat(24), ..request("at-limit", ContextFirst) };
    let id = f.allocate(&ok);
    assert_eq!(id, f.sid(1), "the refused allocations took no id");
    // Two ranges where one is allowed: nothing pinned, still Allocated.
    assert_eq!(f.svc.mark_ready(id, &f.kv_ranges(), &meta()), Err(KvError::TooManyRanges { count: 2, max: 1 }));
    assert_eq!((f.state(id), f.pinned()), (Allocated, 0));
    // A reason above the limit: the session is unchanged.
    assert_eq!(f.svc.reject(id, &long), Err(KvError::FieldTooLong { field: "reason", len: 25, max: 24 }));
    assert_eq!(f.svc.fail(id, &long), Err(KvError::FieldTooLong { field: "reason", len: 25, max: 24 }));
    assert_eq!(f.state(id), Allocated);
    f.svc.release(id).unwrap();
    f.finish();
}

#[test]
fn session_ids_have_one_text_form_and_every_other_text_is_refused() {
    let id = SessionId { incarnation: 0x00ab_cdef_0123_4567, seq: 42 };
    assert_eq!(id.to_string(), "00abcdef01234567-42");
    assert_eq!("00abcdef01234567-42".parse::<SessionId>(), Ok(id));
    let max = SessionId { incarnation: u64::MAX, seq: u64::MAX };
    assert_eq!(max.to_string().parse::<SessionId>(), Ok(max));
    for bad in [
        "",
        "-",
        "00abcdef01234567",
        "00abcdef01234567-",
        "00abcdef01234567-042",
        "00abcdef01234567-+42",
        "00abcdef01234567--42",
        "00ABCDEF01234567-42",
        "0abcdef01234567-42",
        "000abcdef01234567-42",
        "00abcdef01234567-18446744073709551616",
        "00abcdef01234567-42 ",
        " 00abcdef01234567-42",
        "g0abcdef01234567-42",
        "00abcdef01234567-4_2",
    ] {
        assert!(matches!(bad.parse::<SessionId>(), Err(KvError::InvalidValue { field: "session_id", .. })), "{bad:?}");
    }
}

#[test]
fn each_service_has_its_own_incarnation_so_ids_are_never_reused() {
    let a = Fixture::new();
    let b = Fixture::new();
    assert_ne!(a.svc.incarnation(), b.svc.incarnation());
    let ia = a.allocate(&request("inc", ContextFirst));
    let ib = b.allocate(&request("inc", ContextFirst));
    assert_eq!((ia.seq, ib.seq), (1, 1));
    assert_ne!(ia, ib, "the same sequence in two incarnations is two ids");
    assert!(matches!(b.svc.get(ia), Err(KvError::OtherIncarnation { .. })));
    a.svc.release(ia).unwrap();
    b.svc.release(ib).unwrap();
    a.finish();
    b.finish();
}

#[test]
fn the_built_in_reaper_expires_leases_and_frees_pins_without_any_caller_polling() {
    let e = engine("{}");
    let base = e.stats();
    let kv = region(&e, 32768, Permission::RemoteReadWrite);
    let svc = Arc::new(KvSessionService::new(e.clone(), KvConnectorInfo::default(), Arc::new(SystemClock::default())));
    let reaper = svc.start_reaper(Duration::from_millis(50)).unwrap();
    let ranges = [Desc::new(kv.id, 0, 8192), Desc::new(kv.id, 16384, 8192)];
    let short = AllocateRequest { lease_ms: Some(30), ..request("reaped", ContextFirst) };
    let long = AllocateRequest { lease_ms: Some(600_000), ..request("kept", ContextFirst) };
    let s = svc.allocate(&short).unwrap();
    let k = svc.allocate(&long).unwrap();
    svc.mark_ready(s.session_id, &ranges, &meta()).unwrap();
    assert_eq!(e.stats().pinned_ranges, 2);
    // Wall-clock expiry: the clock's anchor plus the monotonic expiry.
    let unix_now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let at = svc.unix_ms(s.lease_expires_at_ms);
    assert!((at - 30 - unix_now).abs() < 1_000, "expiry {at} is not about now ({unix_now}) + 30 ms");
    // Nobody calls poll: the reaper wakes at the expiry (before its 50 ms
    // period), ends the session and drops the pin.
    let deadline = Instant::now() + Duration::from_secs(5);
    while svc.stats().pinned_ranges != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    let st = svc.stats();
    assert_eq!(svc.get(s.session_id).unwrap().state, Expired);
    assert_eq!(
        (st.live_sessions, st.pinned_ranges, st.sessions_expired, st.awaiting_cleanup, st.tombstones),
        (1, 0, 1, 0, 1)
    );
    assert!(st.reaper_ticks >= 1);
    assert_eq!(svc.get(k.session_id).unwrap().state, Allocated, "an unexpired lease is untouched");
    let (r, now) = svc.release_reporting(k.session_id).unwrap();
    assert_eq!((r.state, now), (Released, true));
    let (r, now) = svc.release_reporting(k.session_id).unwrap();
    assert_eq!((r.state, now), (Released, false), "a retry says it did not end it");
    assert!(!svc.release_reporting(s.session_id).unwrap().1, "an expired session was not released by this call");
    // The reaper stops with its handle, and holds the service only weakly.
    reaper.stop();
    let weak = Arc::downgrade(&svc);
    let _r2 = svc.start_reaper(Duration::from_millis(1)).unwrap();
    drop(svc);
    assert!(weak.upgrade().is_none(), "the reaper keeps the service alive");
    drop(_r2);
    e.deregister(kv.id).unwrap();
    drop(kv);
    assert_idle(&e);
    assert_eq!(e.stats(), base);
}

#[test]
fn abort_live_ends_every_live_session_and_leaves_ended_ones() {
    let f = Fixture::new();
    let a = f.ready(&request("al-a", ContextFirst));
    let b = f.allocate(&request("al-b", GenerationFirst));
    let c = f.allocate(&request("al-c", ContextFirst));
    f.svc.complete(f.attach(a).session_id).unwrap();
    f.svc.release(c).unwrap();
    assert_eq!(f.svc.abort_live(), 1);
    assert_eq!((f.state(a), f.state(b), f.state(c)), (Complete, Cancelled, Released));
    let st = f.svc.stats();
    assert_eq!((st.live_sessions, st.tombstones, st.pinned_ranges, st.tracked_transfers), (0, 3, 0, 0));
    f.finish();
}
