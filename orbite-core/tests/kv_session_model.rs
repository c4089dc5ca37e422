//! Property test of the KV session service: random interleavings of every
//! operation (allocate with identical, conflicting and invalid retries, mark
//! ready with valid and invalid metadata, attach, renew, complete, bypass,
//! reject, fail, abort, release, tracked transfers that succeed, fail or are
//! held mid-flight, releasing held tasks, clock jumps, the timer, drain) run
//! against the real service and engine and a reference model.
//!
//! After every step: every session (and tombstone) reads back as the model
//! says, a terminal state never changes, the engine's pinned ranges,
//! prepared transfers and executions are exactly those of the sessions the
//! model says hold them, live count and drain agree. At the end everything
//! is released and the engine is back at its baseline.

mod common;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use orbite_core::fault::FaultDirective;
use orbite_core::session::*;
use orbite_core::*;
use proptest::prelude::*;

use KvSessionState::{Allocated, Attached, Bypassed, Cancelled, Complete, Expired, Failed, Ready, Rejected, Released};

const KEYS: usize = 5;
const SLOTS: usize = 8;
const DEFAULT_LEASE: u64 = 3_000;
const MAX_LEASE: u64 = 10_000;
const RETENTION: u64 = 5_000;
const MAX_LIVE: u64 = 3;
/// High enough never to bind here: sessions that fail in one poll are
/// ended in hash order, so which of them a bound evicts first is not
/// determined (the conformance suite tests the bound).
const MAX_TOMBSTONES: u64 = 1_000;
const LAYOUT: &str = "m/bf16/16x128";
/// Ranges pinned per ready session.
const RANGES: u64 = 2;

fn info() -> KvConnectorInfo {
    KvConnectorInfo {
        default_lease_ms: DEFAULT_LEASE,
        max_lease_ms: MAX_LEASE,
        tombstone_retention_ms: RETENTION,
        max_live_sessions: MAX_LIVE,
        max_tombstones: MAX_TOMBSTONES,
        ..KvConnectorInfo::default()
    }
}

fn meta() -> KvTransferMeta {
    KvTransferMeta { layout: LAYOUT.into(), block_bytes: 1024, blocks: 4 }
}

/// The request a participant makes for `key` (styles, dispositions and
/// leases vary with the key).
fn canonical(key: usize) -> AllocateRequest {
    use KvScheduleStyle::*;
    AllocateRequest {
        request_id: format!("req-{key}"),
        model: "m".into(),
        idempotency_key: format!("key-{key}"),
        style: [ContextFirst, GenerationFirst, Concurrent, Unspecified, GenerationFirst][key],
        disposition: if key % 2 == 1 { KvTransferDisposition::Bypass } else { KvTransferDisposition::Required },
        lease_ms: [Some(2_000), Some(5_000), None, Some(2_500), Some(MAX_LEASE as i64)][key],
        meta: meta(),
    }
}

#[derive(Debug, Clone, Copy)]
enum Alloc {
    /// The canonical request (an identical retry if the key is in use).
    Same,
    /// The same key with other fields.
    Conflict,
    /// Invalid: zero lease, overlong lease, missing request id.
    Invalid(u8),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    /// Retired successfully before it was tracked.
    Done,
    /// Retired with a failure before it was tracked.
    Failed,
    /// Held mid-flight by the fault hooks until released.
    Held,
}

#[derive(Debug, Clone)]
enum Step {
    Allocate(usize, Alloc),
    /// 0: valid; 1: other layout; 2: ranges not covering the KV.
    MarkReady(usize, u8),
    Attach(usize, bool),
    Renew(usize, Option<i64>),
    Complete(usize),
    Bypass(usize),
    Reject(usize),
    Fail(usize),
    Abort(usize),
    Release(usize),
    Track(usize, Work),
    ReleaseHeld {
        fail: bool,
    },
    Advance(u64),
    Poll,
    Drain,
}

fn step() -> impl Strategy<Value = Step> {
    let slot = || 0..SLOTS;
    let alloc = prop_oneof![6 => Just(Alloc::Same), 2 => Just(Alloc::Conflict), 2 => (0..3u8).prop_map(Alloc::Invalid)];
    let work = prop_oneof![3 => Just(Work::Done), 1 => Just(Work::Failed), 3 => Just(Work::Held)];
    let lease = prop::sample::select(vec![None, Some(500), Some(3_000), Some(MAX_LEASE as i64), Some(0), Some(-7)]);
    let advance = prop::sample::select(vec![1u64, 100, 500, 999, 1_000, 2_500, 6_000, 12_000]);
    prop_oneof![
        10 => (0..KEYS, alloc).prop_map(|(k, a)| Step::Allocate(k, a)),
        6 => (slot(), prop_oneof![4 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)]).prop_map(|(s, b)| Step::MarkReady(s, b)),
        6 => (slot(), prop::bool::weighted(0.85)).prop_map(|(s, v)| Step::Attach(s, v)),
        2 => (slot(), lease).prop_map(|(s, l)| Step::Renew(s, l)),
        2 => slot().prop_map(Step::Complete),
        1 => slot().prop_map(Step::Bypass),
        1 => slot().prop_map(Step::Reject),
        1 => slot().prop_map(Step::Fail),
        1 => slot().prop_map(Step::Abort),
        2 => slot().prop_map(Step::Release),
        4 => (slot(), work).prop_map(|(s, w)| Step::Track(s, w)),
        2 => any::<bool>().prop_map(|fail| Step::ReleaseHeld { fail }),
        2 => advance.prop_map(Step::Advance),
        3 => Just(Step::Poll),
        1 => Just(Step::Drain),
    ]
}

/// A session as the model sees it.
#[derive(Debug, Clone)]
struct MSession {
    req: AllocateRequest,
    effective: KvScheduleStyle,
    state: KvSessionState,
    expires: u64,
    queued: bool,
    /// Ranges its pin holds (until cleaned).
    pinned: u64,
    /// Its tracked transfers (held until cleaned).
    work: Vec<Work>,
    /// Tracked work the service has not yet seen retire.
    work_active: bool,
    cleaned: bool,
    ended_at: u64,
    /// Not yet forgotten (tombstone purge).
    present: bool,
}

#[derive(Debug, PartialEq)]
enum Got {
    Session(u64, KvSessionState),
    Queued(u64),
    Err(KvError),
    /// IncompatibleMetadata, whatever the message.
    Incompatible,
}

fn got(r: Result<KvSession, KvError>) -> Got {
    match r {
        Ok(s) => Got::Session(s.session_id.seq, s.state),
        Err(KvError::IncompatibleMetadata(_)) => Got::Incompatible,
        Err(e) => Got::Err(e),
    }
}

#[derive(Default)]
struct Model {
    /// The service's incarnation.
    inc: u64,
    now: u64,
    next_id: u64,
    sessions: BTreeMap<u64, MSession>,
    keys: HashMap<String, u64>,
    tombstones: VecDeque<u64>,
    live: u64,
    draining: bool,
    /// Held transfers whose tracking was refused (the test holds them).
    orphans_held: u64,
}

impl Model {
    fn sid(&self, seq: u64) -> SessionId {
        SessionId { incarnation: self.inc, seq }
    }

    fn entry(&self, id: u64) -> Option<&MSession> {
        self.sessions
            .get(&id)
            .filter(|s| s.present && !(s.state.is_terminal() && s.cleaned && self.now >= s.ended_at + RETENTION))
    }

    /// The checks of a transition on a live session. A lease that ran out
    /// ends the session first, whether or not the timer came by.
    fn live(&mut self, id: u64) -> Result<&MSession, KvError> {
        let s = self.entry(id).ok_or(KvError::NotFound(self.sid(id)))?;
        if !s.state.is_terminal() && s.expires <= self.now {
            self.end(id, Expired);
        }
        let s = &self.sessions[&id];
        if s.state.is_terminal() {
            return Err(KvError::Terminal { session: self.sid(id), state: s.state });
        }
        Ok(s)
    }

    fn end(&mut self, id: u64, state: KvSessionState) -> Got {
        let now = self.now;
        let s = self.sessions.get_mut(&id).unwrap();
        assert!(!s.state.is_terminal());
        s.state = state;
        s.queued = false;
        s.ended_at = now;
        if !s.work_active {
            s.cleaned = true;
        }
        self.live -= 1;
        self.tombstones.push_back(id);
        Got::Session(id, state)
    }

    fn lease(lease: Option<i64>) -> Result<u64, KvError> {
        match lease {
            None => Ok(DEFAULT_LEASE),
            Some(l) if l <= 0 => Err(KvError::InvalidLease(l)),
            Some(l) if l as u64 > MAX_LEASE => Err(KvError::LeaseTooLong { requested: l, max: MAX_LEASE }),
            Some(l) => Ok(l as u64),
        }
    }

    fn allocate(&mut self, req: &AllocateRequest) -> Got {
        if req.request_id.is_empty() {
            return Got::Err(KvError::MissingField("request_id"));
        }
        let lease = match Self::lease(req.lease_ms) {
            Ok(l) => l,
            Err(e) => return Got::Err(e),
        };
        if let Some(&id) = self.keys.get(&req.idempotency_key) {
            if self.entry(id).is_none() {
                // Its tombstone is past its retention: the key is free.
                self.keys.remove(&req.idempotency_key);
                self.sessions.get_mut(&id).unwrap().present = false;
                return self.allocate(req);
            }
            let s = &self.sessions[&id];
            return if &s.req == req {
                Got::Session(id, s.state)
            } else {
                Got::Err(KvError::IdempotencyConflict { key: req.idempotency_key.clone(), session: self.sid(id) })
            };
        }
        if self.draining {
            return Got::Err(KvError::Draining);
        }
        if self.live >= MAX_LIVE {
            return Got::Err(KvError::TooManySessions { limit: MAX_LIVE });
        }
        self.next_id += 1;
        let id = self.next_id;
        let effective = match req.style {
            KvScheduleStyle::Unspecified => info().default_style,
            s => s,
        };
        self.sessions.insert(
            id,
            MSession {
                req: req.clone(),
                effective,
                state: Allocated,
                expires: self.now + lease,
                queued: false,
                pinned: 0,
                work: Vec::new(),
                work_active: false,
                cleaned: false,
                ended_at: 0,
                present: true,
            },
        );
        self.keys.insert(req.idempotency_key.clone(), id);
        self.live += 1;
        Got::Session(id, Allocated)
    }

    fn mark_ready(&mut self, id: u64, bad: u8) -> Got {
        let s = match self.live(id) {
            Ok(s) => s,
            Err(e) => return Got::Err(e),
        };
        if s.state != Allocated {
            let state = s.state;
            return Got::Err(KvError::WrongState { session: self.sid(id), state, op: "mark_ready" });
        }
        if bad != 0 {
            return Got::Incompatible;
        }
        let s = self.sessions.get_mut(&id).unwrap();
        s.state = Ready;
        s.pinned = RANGES;
        Got::Session(id, Ready)
    }

    fn attach(&mut self, id: u64, valid: bool) -> Got {
        let s = match self.live(id) {
            Ok(s) => s,
            Err(e) => return Got::Err(e),
        };
        if !valid {
            return Got::Incompatible;
        }
        let (state, effective) = (s.state, s.effective);
        let s = self.sessions.get_mut(&id).unwrap();
        match state {
            Ready | Attached => {
                s.state = Attached;
                s.queued = false;
                Got::Session(id, Attached)
            }
            Allocated => match effective {
                KvScheduleStyle::GenerationFirst | KvScheduleStyle::Concurrent => {
                    s.queued = true;
                    Got::Queued(id)
                }
                _ => Got::Err(KvError::NotReady(self.sid(id))),
            },
            other => unreachable!("live state {other:?}"),
        }
    }

    fn renew(&mut self, id: u64, lease: Option<i64>) -> Got {
        if let Err(e) = self.live(id) {
            return Got::Err(e);
        }
        let lease = match Self::lease(lease) {
            Ok(l) => l,
            Err(e) => return Got::Err(e),
        };
        let now = self.now;
        let s = self.sessions.get_mut(&id).unwrap();
        s.expires = now + lease;
        Got::Session(id, s.state)
    }

    /// complete, bypass, reject, fail.
    fn transition(&mut self, id: u64, to: KvSessionState) -> Got {
        let inc = self.inc;
        let s = match self.live(id) {
            Ok(s) => s,
            Err(e) => return Got::Err(e),
        };
        match to {
            Complete if s.state != Attached => Got::Err(KvError::WrongState {
                session: SessionId { incarnation: inc, seq: id },
                state: s.state,
                op: "complete",
            }),
            Bypassed if s.req.disposition != KvTransferDisposition::Bypass => Got::Err(KvError::WrongState {
                session: SessionId { incarnation: inc, seq: id },
                state: s.state,
                op: "bypass",
            }),
            _ => self.end(id, to),
        }
    }

    /// abort, release: no-ops on an ended session.
    fn stop(&mut self, id: u64, to: KvSessionState) -> Got {
        let _ = self.live(id); // a due lease ends it as Expired first
        match self.entry(id) {
            None => Got::Err(KvError::NotFound(self.sid(id))),
            Some(s) if s.state.is_terminal() => Got::Session(id, s.state),
            Some(_) => self.end(id, to),
        }
    }

    fn track(&mut self, id: u64, work: Work) -> Result<(), KvError> {
        self.live(id)?;
        let s = self.sessions.get_mut(&id).unwrap();
        s.work.push(work);
        s.work_active = true;
        Ok(())
    }

    fn release_held(&mut self, fail: bool) {
        for s in self.sessions.values_mut() {
            for w in &mut s.work {
                if *w == Work::Held {
                    *w = if fail { Work::Failed } else { Work::Done };
                }
            }
        }
        self.orphans_held = 0;
    }

    fn poll(&mut self) {
        let now = self.now;
        // Leases, earliest first.
        let mut due: Vec<(u64, u64)> = self
            .sessions
            .iter()
            .filter(|(_, s)| !s.state.is_terminal() && s.expires <= now)
            .map(|(&id, s)| (s.expires, id))
            .collect();
        due.sort();
        for (_, id) in due {
            self.end(id, Expired);
        }
        // Tombstones past their retention, oldest end first.
        while let Some(&id) = self.tombstones.front() {
            let s = &self.sessions[&id];
            assert!((self.tombstones.len() as u64) <= MAX_TOMBSTONES);
            if !s.present {
                self.tombstones.pop_front(); // forgotten when its key was reused
                continue;
            }
            if !(s.cleaned && now >= s.ended_at + RETENTION) {
                break;
            }
            self.tombstones.pop_front();
            let key = s.req.idempotency_key.clone();
            self.sessions.get_mut(&id).unwrap().present = false;
            if self.keys.get(&key) == Some(&id) {
                self.keys.remove(&key);
            }
        }
        // Sessions whose tracked work all retired: a failure fails a live
        // one; an ended one is cleaned.
        let ids: Vec<u64> = self.sessions.iter().filter(|(_, s)| s.work_active).map(|(&id, _)| id).collect();
        for id in ids {
            let s = &self.sessions[&id];
            if s.work.contains(&Work::Held) {
                continue;
            }
            if s.work.contains(&Work::Failed) && !s.state.is_terminal() {
                self.end(id, Failed);
            }
            let s = self.sessions.get_mut(&id).unwrap();
            s.work_active = false;
            if s.state.is_terminal() {
                s.cleaned = true;
            }
        }
    }

    fn uncleaned(&self) -> impl Iterator<Item = &MSession> {
        self.sessions.values().filter(|s| !s.cleaned)
    }

    fn pinned(&self) -> u64 {
        self.uncleaned().map(|s| s.pinned).sum()
    }

    fn held(&self) -> u64 {
        self.uncleaned().map(|s| s.work.iter().filter(|w| **w == Work::Held).count() as u64).sum::<u64>()
            + self.orphans_held
    }

    fn tracked(&self) -> u64 {
        self.uncleaned().map(|s| s.work.len() as u64).sum()
    }

    fn is_drained(&self) -> bool {
        self.draining && self.live == 0 && self.sessions.values().all(|s| s.cleaned)
    }
}

struct World {
    e: TransferEngine,
    base: Stats,
    kv: Region,
    dst: Region,
    clock: Arc<ManualClock>,
    svc: KvSessionService,
    model: Model,
    /// Held transfers whose tracking was refused.
    orphans: Vec<Transfer>,
    /// Every terminal state ever seen, by session.
    terminal: HashMap<u64, KvSessionState>,
    posted: u64,
}

impl World {
    fn new() -> World {
        let e = engine(r#"{"local_route_workers": 1}"#);
        let base = e.stats();
        let kv = region(&e, 16384, Permission::RemoteReadWrite);
        let dst = region(&e, 16384, Permission::RemoteReadWrite);
        let clock = Arc::new(ManualClock::default());
        let svc = KvSessionService::new(e.clone(), info(), clock.clone());
        let inc = svc.incarnation();
        World {
            e,
            base,
            kv,
            dst,
            clock,
            svc,
            model: Model { inc, ..Model::default() },
            orphans: Vec::new(),
            terminal: HashMap::new(),
            posted: 0,
        }
    }

    /// A session chosen by `slot`: mostly one of the latest allocated (so
    /// that one session sees several steps), any of them, or one that never
    /// existed.
    fn id(&self, slot: usize) -> u64 {
        let (n, slot) = (self.model.next_id, slot as u64);
        match slot {
            _ if n == 0 || slot == SLOTS as u64 - 1 => 1_000 + slot,
            0..=3 => n,
            4 => (n - 1).max(1),
            _ => 1 + slot % n,
        }
    }

    fn ranges(&self, bad: u8) -> (Vec<Desc>, KvTransferMeta) {
        let r = vec![Desc::new(self.kv.id, 0, 2048), Desc::new(self.kv.id, 8192, 2048)];
        match bad {
            0 => (r, meta()),
            1 => (r, KvTransferMeta { layout: "other".into(), ..meta() }),
            _ => (vec![Desc::new(self.kv.id, 0, 2048), Desc::new(self.kv.id, 8192, 1024)], meta()),
        }
    }

    /// A one-task loopback read, posted and (unless held) retired.
    fn transfer(&mut self, work: Work) -> Result<Transfer, TestCaseError> {
        let directive = match work {
            Work::Done => FaultDirective::Run,
            Work::Failed => FaultDirective::Fail { bytes: 0, effect_unknown: false },
            Work::Held => FaultDirective::Hold,
        };
        let at = (self.posted % 16) * 1024;
        self.posted += 1;
        let (l, r) = ([Desc::new(self.dst.id, at, 1024)], [Desc::new(self.kv.id, 0, 1024)]);
        let t = self.e.prepare(&spec(Op::Read, &l, &r)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        self.e.fault_hooks().push(directive);
        t.post().map_err(|e| TestCaseError::fail(e.to_string()))?;
        match work {
            Work::Held => {
                let n = self.model.held() as usize + 1;
                prop_assert!(self.e.fault_hooks().wait_held(n, WAIT), "the transfer was not held");
            }
            _ => {
                let r = wait_retired(&t);
                prop_assert_eq!(r.outcome.is_success(), work == Work::Done, "{:?}", r);
            }
        }
        Ok(t)
    }

    fn apply(&mut self, step: &Step) -> Result<(), TestCaseError> {
        match *step {
            Step::Allocate(key, how) => {
                let base = canonical(key);
                let req = match how {
                    Alloc::Same => base,
                    Alloc::Conflict => AllocateRequest { request_id: format!("other-{key}"), ..base },
                    Alloc::Invalid(0) => AllocateRequest { lease_ms: Some(0), ..base },
                    Alloc::Invalid(1) => AllocateRequest { lease_ms: Some(MAX_LEASE as i64 + 1), ..base },
                    Alloc::Invalid(_) => AllocateRequest { request_id: String::new(), ..base },
                };
                let want = self.model.allocate(&req);
                let have = self.svc.allocate(&req);
                if let Ok(s) = &have {
                    self.check_session(s)?;
                }
                prop_assert_eq!(got(have), want, "allocate {:?}", req);
            }
            Step::MarkReady(slot, bad) => {
                let id = self.id(slot);
                let (ranges, meta) = self.ranges(bad);
                let want = self.model.mark_ready(id, bad);
                let have = self.svc.mark_ready(self.model.sid(id), &ranges, &meta);
                if let Ok(s) = &have {
                    prop_assert_eq!(s.rendezvous.ranges.len() as u64, RANGES);
                }
                prop_assert_eq!(got(have), want, "mark_ready {} {}", id, bad);
            }
            Step::Attach(slot, valid) => {
                let id = self.id(slot);
                let meta = if valid { meta() } else { KvTransferMeta { blocks: 5, ..meta() } };
                let want = self.model.attach(id, valid);
                let have = match self.svc.attach(self.model.sid(id), &meta) {
                    Ok(AttachOutcome::Attached(s)) => {
                        self.check_session(&s)?;
                        Got::Session(s.session_id.seq, s.state)
                    }
                    Ok(AttachOutcome::Queued(s)) => {
                        self.check_session(&s)?;
                        prop_assert!(s.consumer_queued && s.state == Allocated, "{:?}", s);
                        Got::Queued(s.session_id.seq)
                    }
                    Err(e) => got(Err(e)),
                };
                prop_assert_eq!(have, want, "attach {} {}", id, valid);
            }
            Step::Renew(slot, lease) => {
                let id = self.id(slot);
                let want = self.model.renew(id, lease);
                let have = self.svc.renew(self.model.sid(id), lease);
                if let Ok(s) = &have {
                    self.check_session(s)?;
                }
                prop_assert_eq!(got(have), want, "renew {} {:?}", id, lease);
            }
            Step::Complete(slot) | Step::Bypass(slot) | Step::Reject(slot) | Step::Fail(slot) => {
                let id = self.id(slot);
                let (to, have) = match *step {
                    Step::Complete(_) => (Complete, self.svc.complete(self.model.sid(id))),
                    Step::Bypass(_) => (Bypassed, self.svc.bypass(self.model.sid(id))),
                    Step::Reject(_) => (Rejected, self.svc.reject(self.model.sid(id), "rejected")),
                    _ => (Failed, self.svc.fail(self.model.sid(id), "failed")),
                };
                let want = self.model.transition(id, to);
                prop_assert_eq!(got(have), want, "{:?} {}", to, id);
            }
            Step::Abort(slot) | Step::Release(slot) => {
                let id = self.id(slot);
                let (to, have) = match *step {
                    Step::Abort(_) => (Cancelled, self.svc.abort(self.model.sid(id))),
                    _ => (Released, self.svc.release(self.model.sid(id))),
                };
                let want = self.model.stop(id, to);
                prop_assert_eq!(got(have), want, "{:?} {}", to, id);
            }
            Step::Track(slot, work) => {
                let id = self.id(slot);
                let t = self.transfer(work)?;
                let want = self.model.track(id, work);
                match (self.svc.track_transfer(self.model.sid(id), t), want) {
                    (Ok(_), Ok(())) => {}
                    (Err((t, e)), Err(w)) => {
                        prop_assert_eq!(e, w);
                        if work == Work::Held {
                            self.orphans.push(t);
                            self.model.orphans_held += 1;
                        }
                    }
                    (have, want) => {
                        return Err(TestCaseError::fail(format!(
                            "track {id}: service {:?}, model {want:?}",
                            have.map_err(|(_, e)| e)
                        )));
                    }
                }
            }
            Step::ReleaseHeld { fail } => {
                let hooks = self.e.fault_hooks();
                let d =
                    if fail { FaultDirective::Fail { bytes: 0, effect_unknown: false } } else { FaultDirective::Run };
                for t in hooks.held() {
                    prop_assert!(hooks.release(t, d));
                }
                prop_assert!(self.e.wait_idle(WAIT));
                self.orphans.clear();
                self.model.release_held(fail);
            }
            Step::Advance(ms) => {
                self.clock.advance(ms);
                self.model.now += ms;
            }
            Step::Poll => {
                self.model.poll();
                prop_assert_eq!(self.svc.poll(), self.model.live, "live count after poll");
            }
            Step::Drain => {
                self.svc.start_drain();
                self.model.draining = true;
            }
        }
        Ok(())
    }

    /// A session the service returned agrees with the model.
    fn check_session(&self, s: &KvSession) -> Result<(), TestCaseError> {
        prop_assert_eq!(s.session_id.incarnation, self.model.inc);
        let id = s.session_id.seq;
        let Some(m) = self.model.sessions.get(&id) else {
            return Err(TestCaseError::fail(format!("unknown session {s:?}")));
        };
        prop_assert_eq!(
            (s.state, s.lease_expires_at_ms, s.consumer_queued, s.style, s.effective_style, s.disposition),
            (m.state, m.expires, m.queued, m.req.style, m.effective, m.req.disposition),
            "session {}",
            id
        );
        prop_assert_eq!(&s.idempotency_key, &m.req.idempotency_key);
        prop_assert!(s.lease_expires_at_ms <= self.model.now + MAX_LEASE, "immortal: {:?}", s);
        prop_assert_eq!(s.rendezvous.ranges.len() as u64, if m.pinned > 0 { RANGES } else { 0 });
        Ok(())
    }

    /// The invariants, after every step.
    fn check(&mut self) -> Result<(), TestCaseError> {
        // First (before any call that could run pending effects): pinned
        // ranges, transfers and executions are exactly those of the
        // sessions the model says hold them (plus refused held transfers).
        let want = (self.model.pinned(), self.model.tracked() + self.orphans.len() as u64, self.model.held());
        let start = Instant::now();
        loop {
            let s = self.e.stats();
            let have = (s.pinned_ranges, s.prepared_transfers, s.executions);
            if have == want && self.e.fault_hooks().held().len() as u64 == want.2 {
                break;
            }
            // Every transfer was waited for (retired or held) before this
            // check: a short grace only covers refunds racing the waiter.
            if start.elapsed() > Duration::from_millis(200) {
                return Err(TestCaseError::fail(format!(
                    "(pinned, prepared, executions) {have:?}, model {want:?}; held {}",
                    self.e.fault_hooks().held().len()
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        prop_assert_eq!(self.svc.live_count(), self.model.live);
        prop_assert_eq!(self.svc.is_drained(), self.model.is_drained(), "is_drained");
        // Every session and tombstone reads back as the model says; a
        // terminal state never changes; a forgotten tombstone is NotFound.
        for id in 1..=self.model.next_id + 1 {
            let have = self.svc.get(self.model.sid(id));
            match (&have, self.model.entry(id)) {
                (Ok(s), Some(_)) => self.check_session(s)?,
                (Err(KvError::NotFound(n)), None) if *n == self.model.sid(id) => {}
                (have, want) => {
                    return Err(TestCaseError::fail(format!("get {id}: service {have:?}, model {want:?}")));
                }
            }
            if let Ok(s) = have {
                if let Some(&was) = self.terminal.get(&id) {
                    prop_assert_eq!(s.state, was, "terminal session {} changed", id);
                }
                if s.state.is_terminal() {
                    self.terminal.insert(id, s.state);
                }
            }
        }
        // Reading changed nothing.
        let s = self.e.stats();
        prop_assert_eq!((s.pinned_ranges, s.prepared_transfers), (want.0, want.1), "get changed the charges");
        Ok(())
    }

    /// Releases everything, lets held work go, polls until drained; the
    /// engine ends at its baseline.
    fn finish(mut self) -> Result<(), TestCaseError> {
        self.svc.start_drain();
        self.model.draining = true;
        for id in 1..=self.model.next_id {
            let want = self.model.stop(id, Released);
            prop_assert_eq!(got(self.svc.release(self.model.sid(id))), want, "final release {}", id);
        }
        self.apply(&Step::ReleaseHeld { fail: false })?;
        self.apply(&Step::Poll)?;
        self.check()?;
        prop_assert!(self.svc.is_drained(), "not drained at the end");
        prop_assert_eq!((self.svc.live_count(), self.e.stats().pinned_ranges), (0, 0));
        let World { e, base, kv, dst, svc, .. } = self;
        e.deregister(kv.id).unwrap();
        e.deregister(dst.id).unwrap();
        drop((kv, dst));
        prop_assert_eq!(e.stats(), base, "the engine's charges are not at baseline");
        drop(svc);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, max_shrink_time: 30_000, ..ProptestConfig::default() })]
    #[test]
    fn sessions_match_reference_model(steps in prop::collection::vec(step(), 1..40)) {
        let mut w = World::new();
        for s in &steps {
            w.apply(s)?;
            w.check()?;
        }
        w.finish()?;
    }
}
