//! The session state machine: sans-IO. It takes no lock, starts no thread
//! and reads no clock: every operation is given the time (milliseconds on
//! the caller's clock) and what the runtime must do comes out as
//! [`Effect`]s.

use std::collections::{BTreeSet, HashMap, VecDeque};

use super::{
    AllocateRequest, KvConnectorInfo, KvError, KvRangeRef, KvRendezvous, KvScheduleStyle, KvSession, KvSessionState,
    KvTransferDisposition, KvTransferMeta, SessionId,
};

/// What the runtime must do for a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Effect {
    /// The session ended while work may run: cancel its queued transfers
    /// and let running ones drain.
    StopWork(SessionId),
    /// The session ended and none of its work can run any more: free its
    /// pins and transfers. Emitted exactly once per session.
    Cleanup(SessionId),
}

/// What an attach did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttachOutcome {
    /// The consumer is attached and may read the ranges.
    Attached(KvSession),
    /// The KV is not ready; the consumer waits (generation-first and
    /// concurrent styles). Not a failure: attach again once ready.
    Queued(KvSession),
}

struct Entry {
    session: KvSession,
    request: AllocateRequest,
    work_active: bool,
    cleaned: bool,
    ended_at: u64,
}

/// The sessions of one service.
pub struct SessionMachine {
    info: KvConnectorInfo,
    endpoint: String,
    epoch: u64,
    incarnation: u64,
    next_seq: u64,
    entries: HashMap<SessionId, Entry>,
    keys: HashMap<String, SessionId>,
    /// (expiry, session) of every live session: renewing moves the key, so
    /// the first key is always the next lease to run out.
    leases: BTreeSet<(u64, SessionId)>,
    /// Terminal sessions, oldest end first.
    tombstones: VecDeque<SessionId>,
    /// The first key of `leases` (`u64::MAX` for none): a tick with nothing
    /// due reads this and not the set.
    next_due: u64,
    /// The earliest time the oldest tombstone may be forgotten (0: check at
    /// every tick, `u64::MAX`: no tombstone).
    tomb_check_at: u64,
    live: u64,
    /// Ended sessions not yet cleaned up.
    uncleaned: u64,
    expired: u64,
    /// Allocations answered with the session an identical earlier
    /// request created.
    retried: u64,
    draining: bool,
    effects: Vec<Effect>,
    reaper_visits: u64,
}

fn bounded(field: &'static str, value: &str, max: u64) -> Result<(), KvError> {
    if value.len() as u64 > max {
        return Err(KvError::FieldTooLong { field, len: value.len() as u64, max });
    }
    Ok(())
}

fn positive_lease(info: &KvConnectorInfo, lease_ms: Option<i64>) -> Result<u64, KvError> {
    match lease_ms {
        None => Ok(info.default_lease_ms),
        Some(l) if l <= 0 => Err(KvError::InvalidLease(l)),
        Some(l) if l as u64 > info.max_lease_ms => Err(KvError::LeaseTooLong { requested: l, max: info.max_lease_ms }),
        Some(l) => Ok(l as u64),
    }
}

fn check_meta(meta: &KvTransferMeta) -> Result<(), KvError> {
    if meta.layout.is_empty() {
        return Err(KvError::MissingField("meta.layout"));
    }
    if meta.block_bytes == 0 || meta.blocks == 0 || meta.block_bytes.checked_mul(meta.blocks).is_none() {
        return Err(KvError::IncompatibleMetadata(format!(
            "{} blocks of {} bytes is not a KV size",
            meta.blocks, meta.block_bytes
        )));
    }
    Ok(())
}

fn same_meta(session: &KvSession, meta: &KvTransferMeta) -> Result<(), KvError> {
    if &session.meta == meta {
        Ok(())
    } else {
        Err(KvError::IncompatibleMetadata(format!(
            "session {} has {:?} x {} bytes x {} blocks, got {:?} x {} x {}",
            session.session_id,
            session.meta.layout,
            session.meta.block_bytes,
            session.meta.blocks,
            meta.layout,
            meta.block_bytes,
            meta.blocks
        )))
    }
}

impl SessionMachine {
    /// A machine advertising `info`, for the engine at `endpoint`/`epoch`,
    /// allocating ids of `incarnation` (pick a fresh random value at every
    /// start: ids of other incarnations answer `OtherIncarnation`).
    pub fn new(info: KvConnectorInfo, endpoint: String, epoch: u64, incarnation: u64) -> Self {
        SessionMachine {
            info,
            endpoint,
            epoch,
            incarnation,
            next_seq: 1,
            entries: HashMap::new(),
            keys: HashMap::new(),
            leases: BTreeSet::new(),
            tombstones: VecDeque::new(),
            next_due: u64::MAX,
            tomb_check_at: u64::MAX,
            live: 0,
            uncleaned: 0,
            expired: 0,
            retried: 0,
            draining: false,
            effects: Vec::new(),
            reaper_visits: 0,
        }
    }

    /// What this service supports.
    pub fn info(&self) -> &KvConnectorInfo {
        &self.info
    }

    /// The first checks of [`Self::allocate`], in its order: `request_id`,
    /// `model` and `idempotency_key` present, then every text field (the
    /// layout too) within `max_field_bytes`.
    pub fn check_allocate_fields(
        &self,
        request_id: &str,
        model: &str,
        idempotency_key: &str,
        layout: &str,
    ) -> Result<(), KvError> {
        self.offered("caller_allocation", self.info.caller_allocation)?;
        for (name, value) in [("request_id", request_id), ("model", model), ("idempotency_key", idempotency_key)] {
            if value.is_empty() {
                return Err(KvError::MissingField(name));
            }
        }
        let max = self.info.max_field_bytes;
        for (name, value) in [
            ("request_id", request_id),
            ("model", model),
            ("idempotency_key", idempotency_key),
            ("meta.layout", layout),
        ] {
            bounded(name, value, max)?;
        }
        Ok(())
    }

    /// Allocates a session, or returns the one an identical earlier request
    /// with the same idempotency key created.
    pub fn allocate(&mut self, req: &AllocateRequest, now: u64) -> Result<KvSession, KvError> {
        self.check_allocate_fields(&req.request_id, &req.model, &req.idempotency_key, &req.meta.layout)?;
        let effective_style = match req.style {
            KvScheduleStyle::Unspecified => self.info.default_style,
            s if self.info.supported_styles.contains(&s) => s,
            s => return Err(KvError::UnsupportedStyle(s)),
        };
        if req.disposition == KvTransferDisposition::Bypass && !self.info.conditional_bypass {
            return Err(KvError::BypassNotSupported);
        }
        let lease = positive_lease(&self.info, req.lease_ms)?;
        check_meta(&req.meta)?;
        if let Some(&id) = self.keys.get(&req.idempotency_key) {
            let entry = &self.entries[&id];
            if entry.session.state.is_terminal() && self.retention_over(entry, now) {
                // Its tombstone is gone for `get` too: the key is free.
                self.keys.remove(&req.idempotency_key);
                self.entries.remove(&id);
                return self.allocate(req, now);
            }
            return if &entry.request == req {
                self.retried += 1;
                Ok(entry.session.clone())
            } else {
                Err(KvError::IdempotencyConflict { key: req.idempotency_key.clone(), session: id })
            };
        }
        if self.draining {
            return Err(KvError::Draining);
        }
        if self.live >= self.info.max_live_sessions {
            return Err(KvError::TooManySessions { limit: self.info.max_live_sessions });
        }
        let id = SessionId { incarnation: self.incarnation, seq: self.next_seq };
        self.next_seq += 1;
        let expires = now.saturating_add(lease);
        let session = KvSession {
            session_id: id,
            request_id: req.request_id.clone(),
            model: req.model.clone(),
            idempotency_key: req.idempotency_key.clone(),
            style: req.style,
            effective_style,
            disposition: req.disposition,
            state: KvSessionState::Allocated,
            lease_expires_at_ms: expires,
            consumer_queued: false,
            rendezvous: KvRendezvous {
                endpoint: self.endpoint.clone(),
                epoch: self.epoch,
                session_id: id,
                ranges: Vec::new(),
            },
            meta: req.meta.clone(),
            reason: None,
        };
        self.entries.insert(
            id,
            Entry { session: session.clone(), request: req.clone(), work_active: false, cleaned: false, ended_at: 0 },
        );
        self.keys.insert(req.idempotency_key.clone(), id);
        self.leases.insert((expires, id));
        self.next_due = self.next_due.min(expires);
        self.live += 1;
        Ok(session)
    }

    fn entry(&self, id: SessionId, now: u64) -> Result<&Entry, KvError> {
        if id.incarnation != self.incarnation {
            return Err(KvError::OtherIncarnation { session: id.to_string(), incarnation: self.incarnation });
        }
        match self.entries.get(&id) {
            Some(e) if e.session.state.is_terminal() && self.retention_over(e, now) => Err(KvError::NotFound(id)),
            Some(e) => Ok(e),
            None => Err(KvError::NotFound(id)),
        }
    }

    fn retention_over(&self, e: &Entry, now: u64) -> bool {
        e.cleaned && now >= e.ended_at.saturating_add(self.info.tombstone_retention_ms)
    }

    /// A live session, for a transition. A lease that ran out by `now`
    /// ends the session first (whether or not a tick came by), so nothing
    /// revives it.
    fn live_entry(&mut self, id: SessionId, now: u64) -> Result<&mut Entry, KvError> {
        let e = self.entry(id, now)?;
        if !e.session.state.is_terminal() && e.session.lease_expires_at_ms <= now {
            self.end(id, KvSessionState::Expired, Some("lease expired"), now);
        }
        let state = self.entry(id, now)?.session.state;
        if state.is_terminal() {
            return Err(KvError::Terminal { session: id, state });
        }
        Ok(self.entries.get_mut(&id).expect("checked"))
    }

    /// The session, live or a tombstone within its retention (a caller's
    /// lookup: refused where `session_lookup` is off).
    pub fn get(&self, id: SessionId, now: u64) -> Result<KvSession, KvError> {
        self.offered("session_lookup", self.info.session_lookup)?;
        self.session(id, now)
    }

    /// [`Self::get`] for the service itself, whatever is advertised.
    pub(crate) fn session(&self, id: SessionId, now: u64) -> Result<KvSession, KvError> {
        Ok(self.entry(id, now)?.session.clone())
    }

    /// `Ok` if capability `name` is on (`on`), else why the operation is
    /// refused.
    fn offered(&self, name: &'static str, on: bool) -> Result<(), KvError> {
        if on { Ok(()) } else { Err(KvError::CapabilityOff(name)) }
    }

    /// Extends the lease of a live session to `now + lease`.
    pub fn renew(&mut self, id: SessionId, lease_ms: Option<i64>, now: u64) -> Result<KvSession, KvError> {
        if !self.info.renewable_leases {
            let state = self.entry(id, now)?.session.state;
            return Err(KvError::WrongState { session: id, state, op: "renew" });
        }
        self.live_entry(id, now)?;
        let lease = positive_lease(&self.info, lease_ms)?;
        let e = self.entries.get_mut(&id).expect("checked");
        let old = e.session.lease_expires_at_ms;
        let new = now.saturating_add(lease);
        e.session.lease_expires_at_ms = new;
        let session = e.session.clone();
        self.leases.remove(&(old, id));
        self.leases.insert((new, id));
        self.refresh_due();
        Ok(session)
    }

    /// Checks what `mark_ready` would check, changing nothing (so that a
    /// runtime can pin ranges only for a call that will succeed).
    pub fn check_ready(
        &mut self,
        id: SessionId,
        ranges: &[KvRangeRef],
        meta: &KvTransferMeta,
        now: u64,
    ) -> Result<(), KvError> {
        if ranges.len() as u64 > self.info.max_ranges {
            return Err(KvError::TooManyRanges { count: ranges.len() as u64, max: self.info.max_ranges });
        }
        self.live_entry(id, now)?;
        let e = self.entry(id, now)?;
        let state = e.session.state;
        if state.is_terminal() {
            return Err(KvError::Terminal { session: id, state });
        }
        if e.session.lease_expires_at_ms <= now {
            return Err(KvError::Terminal { session: id, state: KvSessionState::Expired });
        }
        if state != KvSessionState::Allocated {
            return Err(KvError::WrongState { session: id, state, op: "mark_ready" });
        }
        same_meta(&e.session, meta)?;
        let total = ranges.iter().try_fold(0u64, |a, r| if r.len == 0 { None } else { a.checked_add(r.len) });
        let want = meta.block_bytes * meta.blocks;
        if total != Some(want) {
            return Err(KvError::IncompatibleMetadata(format!(
                "ranges cover {total:?} bytes, the session's KV is {want} bytes"
            )));
        }
        Ok(())
    }

    /// The producer filled the KV: `ranges` are pinned and ready.
    pub fn mark_ready(
        &mut self,
        id: SessionId,
        ranges: &[KvRangeRef],
        meta: &KvTransferMeta,
        now: u64,
    ) -> Result<KvSession, KvError> {
        self.live_entry(id, now)?;
        self.check_ready(id, ranges, meta, now)?;
        let e = self.entries.get_mut(&id).expect("checked");
        e.session.state = KvSessionState::Ready;
        e.session.rendezvous.ranges = ranges.to_vec();
        Ok(e.session.clone())
    }

    /// The consumer attaches. Before the KV is ready it queues
    /// (generation-first, concurrent) or is told to retry (context-first).
    pub fn attach(&mut self, id: SessionId, meta: &KvTransferMeta, now: u64) -> Result<AttachOutcome, KvError> {
        let e = self.live_entry(id, now)?;
        same_meta(&e.session, meta)?;
        match e.session.state {
            KvSessionState::Ready | KvSessionState::Attached => {
                e.session.state = KvSessionState::Attached;
                e.session.consumer_queued = false;
                Ok(AttachOutcome::Attached(e.session.clone()))
            }
            KvSessionState::Allocated => match e.session.effective_style {
                KvScheduleStyle::GenerationFirst | KvScheduleStyle::Concurrent => {
                    e.session.consumer_queued = true;
                    Ok(AttachOutcome::Queued(e.session.clone()))
                }
                _ => Err(KvError::NotReady(id)),
            },
            state => Err(KvError::WrongState { session: id, state, op: "attach" }),
        }
    }

    /// The consumer has what it needs.
    pub fn complete(&mut self, id: SessionId, now: u64) -> Result<KvSession, KvError> {
        let e = self.live_entry(id, now)?;
        if e.session.state != KvSessionState::Attached {
            return Err(KvError::WrongState { session: id, state: e.session.state, op: "complete" });
        }
        Ok(self.end(id, KvSessionState::Complete, None, now))
    }

    /// The consumer goes on without the transfer (disposition `Bypass`).
    pub fn bypass(&mut self, id: SessionId, now: u64) -> Result<KvSession, KvError> {
        let e = self.live_entry(id, now)?;
        if e.session.disposition != KvTransferDisposition::Bypass {
            return Err(KvError::WrongState { session: id, state: e.session.state, op: "bypass" });
        }
        Ok(self.end(id, KvSessionState::Bypassed, None, now))
    }

    /// A participant refuses the session (also after KV was pinned).
    pub fn reject(&mut self, id: SessionId, reason: &str, now: u64) -> Result<KvSession, KvError> {
        bounded("reason", reason, self.info.max_field_bytes)?;
        self.live_entry(id, now)?;
        Ok(self.end(id, KvSessionState::Rejected, Some(reason), now))
    }

    /// A transfer failed or a peer was lost.
    pub fn fail(&mut self, id: SessionId, reason: &str, now: u64) -> Result<KvSession, KvError> {
        bounded("reason", reason, self.info.max_field_bytes)?;
        self.live_entry(id, now)?;
        Ok(self.end(id, KvSessionState::Failed, Some(reason), now))
    }

    /// Stops the session: `Cancelled` if it was live; a terminal session is
    /// returned unchanged.
    pub fn abort(&mut self, id: SessionId, now: u64) -> Result<KvSession, KvError> {
        let _ = self.live_entry(id, now); // a due lease ends it as Expired first
        let e = self.entry(id, now)?;
        if e.session.state.is_terminal() {
            return Ok(e.session.clone());
        }
        Ok(self.end(id, KvSessionState::Cancelled, Some("aborted"), now))
    }

    /// Relinquishes the session: `Released` if it was live; a terminal
    /// session is returned unchanged (release is idempotent).
    pub fn release(&mut self, id: SessionId, now: u64) -> Result<KvSession, KvError> {
        self.release_reporting(id, now).map(|(s, _)| s)
    }

    /// [`Self::release`], also saying whether this call ended the session
    /// (false: it had ended before, or its lease had run out).
    pub fn release_reporting(&mut self, id: SessionId, now: u64) -> Result<(KvSession, bool), KvError> {
        self.offered("explicit_release", self.info.explicit_release)?;
        let _ = self.live_entry(id, now); // a due lease ends it as Expired first
        let e = self.entry(id, now)?;
        if e.session.state.is_terminal() {
            return Ok((e.session.clone(), false));
        }
        Ok((self.end(id, KvSessionState::Released, None, now), true))
    }

    /// The runtime started work (a transfer) for a live session: its
    /// cleanup now waits for [`Self::work_retired`].
    pub fn work_started(&mut self, id: SessionId, now: u64) -> Result<(), KvError> {
        self.live_entry(id, now)?.work_active = true;
        Ok(())
    }

    /// The runtime proved that all of a session's work retired.
    pub fn work_retired(&mut self, id: SessionId) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.work_active = false;
        }
        self.maybe_cleanup(id);
    }

    /// Whether the session has work the runtime has not seen retire.
    pub fn work_active(&self, id: SessionId) -> bool {
        self.entries.get(&id).is_some_and(|e| e.work_active)
    }

    fn end(&mut self, id: SessionId, state: KvSessionState, reason: Option<&str>, now: u64) -> KvSession {
        let e = self.entries.get_mut(&id).expect("caller checked");
        debug_assert!(!e.session.state.is_terminal());
        e.session.state = state;
        e.session.reason = reason.filter(|r| !r.is_empty()).map(str::to_owned);
        e.session.consumer_queued = false;
        e.ended_at = now;
        let session = e.session.clone();
        self.uncleaned += 1;
        if state == KvSessionState::Expired {
            self.expired += 1;
        }
        if e.work_active {
            self.effects.push(Effect::StopWork(id));
        }
        if self.leases.remove(&(session.lease_expires_at_ms, id)) {
            self.refresh_due();
        }
        self.live -= 1;
        self.tombstones.push_back(id);
        self.tomb_check_at = self.tomb_check_at.min(now.saturating_add(self.info.tombstone_retention_ms));
        self.maybe_cleanup(id);
        session
    }

    fn maybe_cleanup(&mut self, id: SessionId) {
        if let Some(e) = self.entries.get_mut(&id) {
            if e.session.state.is_terminal() && !e.work_active && !e.cleaned {
                e.cleaned = true;
                self.uncleaned -= 1;
                self.effects.push(Effect::Cleanup(id));
            }
        }
    }

    /// Expires every live session whose lease ran out by `now` and forgets
    /// tombstones past their retention (or beyond the bound). Touches only
    /// the leases that expire.
    pub fn tick(&mut self, now: u64) {
        while self.next_due <= now {
            let Some((_, id)) = self.leases.pop_first() else { break };
            self.refresh_due();
            self.reaper_visits += 1;
            self.end(id, KvSessionState::Expired, Some("lease expired"), now);
        }
        if now < self.tomb_check_at && self.tombstones.len() as u64 <= self.info.max_tombstones {
            return;
        }
        self.tomb_check_at = u64::MAX;
        while let Some(&id) = self.tombstones.front() {
            let Some(e) = self.entries.get(&id) else {
                self.tombstones.pop_front(); // its key was reused after retention
                continue;
            };
            let over_bound = self.tombstones.len() as u64 > self.info.max_tombstones;
            if !(e.cleaned && (over_bound || self.retention_over(e, now))) {
                // Not yet: when it may be forgotten (if cleaned), or at
                // every tick until its cleanup.
                self.tomb_check_at =
                    if e.cleaned { e.ended_at.saturating_add(self.info.tombstone_retention_ms) } else { 0 };
                break;
            }
            self.tombstones.pop_front();
            let e = self.entries.remove(&id).expect("tombstone");
            if self.keys.get(&e.session.idempotency_key) == Some(&id) {
                self.keys.remove(&e.session.idempotency_key);
            }
        }
    }

    fn refresh_due(&mut self) {
        self.next_due = self.leases.first().map_or(u64::MAX, |&(t, _)| t);
    }

    /// What the runtime must do now.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// Stops new allocations (identical retries still get their session).
    pub fn start_drain(&mut self) {
        self.draining = true;
    }

    /// Live (non-terminal) sessions.
    pub fn live_count(&self) -> u64 {
        self.live
    }

    /// Draining, nothing live and every ended session cleaned up.
    pub fn is_drained(&self) -> bool {
        self.draining && self.live == 0 && self.uncleaned == 0
    }

    /// Whether new allocations are refused.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Ended sessions whose work has not retired yet (not cleaned up).
    pub fn awaiting_cleanup(&self) -> u64 {
        self.uncleaned
    }

    /// Sessions ended by lease expiry so far.
    pub fn expired_count(&self) -> u64 {
        self.expired
    }

    /// Allocations answered by an identical earlier request's session.
    pub fn retried_count(&self) -> u64 {
        self.retried
    }

    /// This machine's incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The next lease to run out, on the caller's clock.
    pub fn next_expiry(&self) -> Option<u64> {
        (self.next_due != u64::MAX).then_some(self.next_due)
    }

    /// Every live session, in id order.
    pub fn live_ids(&self) -> Vec<SessionId> {
        let mut ids: Vec<SessionId> = self.leases.iter().map(|&(_, id)| id).collect();
        ids.sort_unstable();
        ids
    }

    /// Whether a decode request may run without a session.
    pub fn check_sessionless_decode(&self, disposition: KvTransferDisposition) -> Result<(), KvError> {
        let bypass = disposition == KvTransferDisposition::Bypass && self.info.conditional_bypass;
        if bypass || self.info.local_prefill { Ok(()) } else { Err(KvError::SessionRequired) }
    }

    /// Leases the reaper has looked at so far (each one expired).
    pub fn reaper_visits(&self) -> u64 {
        self.reaper_visits
    }

    /// Sessions kept (live and tombstones).
    pub fn kept(&self) -> usize {
        self.entries.len()
    }
}
