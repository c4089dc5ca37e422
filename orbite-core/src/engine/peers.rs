//! The engine's peers: opening a segment, keeping its view up to date,
//! finding and resolving a peer's ranges, borrowing them for one-sided
//! routes, control calls and notifications to a peer, closing.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::engine::transfer::{Peer, RemoteLoan, RouteTask};
use crate::engine::{EngineInner, RemoteSegment};
use crate::error::{Error, PeerError};
use crate::segment::{Delta, ExportedRegistration, SegmentView};
use crate::transport::link::{Initiators, PeerLink};

use crate::transport::peer_errors::LocalError;
use crate::transport::proto::client::{ControlDone, ControlJob, PeerFailure, PeerJob};
use crate::transport::routes::{PeerOpening, PeerStates, SameHost, map_shared};
use crate::wire::{Kind, NotifyEnvelope};
/// A one-shot answer slot for a synchronous peer call.
type Reply = (Mutex<Option<Result<Vec<u8>, PeerFailure>>>, Condvar);

impl EngineInner {
    pub(crate) fn open_segment(
        &self,
        endpoint: &str,
        expected_epoch: Option<u64>,
        timeout: Duration,
    ) -> Result<RemoteSegment, Error> {
        self.check_open()?;
        if expected_epoch == Some(self.epoch) {
            return Err(PeerError::OwnEngine { epoch: self.epoch }.into());
        }
        let c = &self.config;
        let opts = crate::transport::link::LinkOptions {
            connections: c.connections_per_peer,
            io_timeout: c.peer_timeout(),
            min_rate: c.peer_min_bytes_per_s,
            limits: self.frame_limits(),
            max_descriptor: c.max_frame_body as usize,
            window: c.tcp_window(),
            boot_id: self.boot_id,
            own_socket: self.listener.local_socket.get().map(|s| Arc::from(s.as_str())),
            keepalive: (c.peer_keepalive_ms > 0).then(|| Duration::from_millis(c.peer_keepalive_ms)),
        };
        use crate::transport::link::OpenError;
        let initiators = self.initiators().map_err(|e| PeerError::Connect(format!("the event loop: {e}")))?;
        let secret = self.listener.secret.clone();
        let link =
            PeerLink::open(&initiators, endpoint, expected_epoch, timeout, self.epoch, opts, secret).map_err(|e| {
                match e {
                    OpenError::Connect(m) => PeerError::Connect(m),
                    OpenError::Protocol(m) => PeerError::Protocol(m),
                    OpenError::EpochMismatch { expected, found } => PeerError::EpochMismatch { expected, found },
                    OpenError::Unauthenticated(m) => {
                        self.note_auth_failure(endpoint, &format!("failed authentication: {m}"));
                        PeerError::Unauthenticated(m)
                    }
                    OpenError::OwnEngine => PeerError::OwnEngine { epoch: self.epoch },
                }
            })?;
        let same_host = self.same_host(&link);
        // A peer's view holds at most as many registrations as this engine
        // would itself.
        let bound = usize::try_from(c.max_registrations).unwrap_or(usize::MAX);
        let view = SegmentView::bounded(&link.descriptor, bound)
            .map_err(|e| PeerError::Protocol(format!("the peer's description: {e}")))?;
        // What each route keeps for it (a proven same-host peer hands over
        // its shared allocations over its local socket), and its inbox.
        // Queue pairs are connected over the first connection, which is
        // authenticated (or the engine runs without a secret).
        let control = |kind: Kind, body: Vec<u8>| {
            let deadline = crate::time::deadline_after(c.peer_timeout());
            self.call_on(&link, deadline, true, |done| PeerJob::Control(ControlJob { kind, flags: 0, body, done }))
                .map_err(|e| e.to_string())
        };
        // A round trip on the control connection, answered or not: a peer
        // that is gone fails it, and its link is lost (one page of its
        // registrations is the smallest answer a target gives).
        let probe: Arc<dyn Fn() + Send + Sync> = {
            let weak = Arc::downgrade(&link);
            let (mine, theirs) = (self.epoch, link.descriptor.epoch);
            Arc::new(move || {
                let Some(link) = weak.upgrade() else { return };
                let mut body = Vec::new();
                let d = crate::wire::DescribeSince {
                    initiator_epoch: mine,
                    expected_epoch: theirs,
                    since: 0,
                    max_reply: 1024 + crate::segment::DELTA_HEADER as u64,
                };
                crate::wire::encode_describe_since(&mut body, &d);
                let done: ControlDone = Box::new(|_| {});
                link.submit_first(PeerJob::Control(ControlJob { kind: Kind::DescribeSince, flags: 0, body, done }));
            })
        };
        let opening = PeerOpening {
            descriptor: &link.descriptor,
            same_host: same_host.as_ref(),
            local: &*link,
            rails: &self.routes.rails,
            qps_per_nic: c.rdma_qps_per_nic,
            timeout: c.peer_timeout(),
            control: &control,
            probe,
        };
        let routes = PeerStates::open(&opening);
        let inbox_name = link.descriptor.inbox.clone();
        let inbox = match same_host {
            Ok(_) if !inbox_name.is_empty() => {
                let m = map_shared(&[inbox_name], |n| opening.local.shared(n)).pop().and_then(|(_, m)| m.ok());
                m.and_then(|m| {
                    // SAFETY: a live shared mapping of the peer's inbox,
                    // kept alive by the Arc stored next to the view.
                    let view = unsafe { crate::transport::inbox::Inbox::open(m.ptr, m.len, link.descriptor.epoch) }?;
                    Some((m, view))
                })
            }
            _ => None,
        };
        let liveness = same_host.as_ref().ok().map(|h| initiators.watch_process(h.pid));
        let peer = Arc::new(Peer::new(link, endpoint, view, routes, same_host, liveness, inbox));
        // What changed between the Describe and the subscription, then
        // every change the peer pushes from now on, as it happens.
        let mut since = peer.view().version;
        if let Some((base, delta)) = peer.link.take_first_changes() {
            since = delta.version;
            if !peer.apply(base, delta) {
                return Err(PeerError::Protocol("the peer's first changes do not apply".into()).into());
            }
        }
        peer.map_pending();
        let weak = Arc::downgrade(&peer);
        peer.link
            .start_watch(since, Box::new(move |base, delta| weak.upgrade().is_some_and(|p| p.apply(base, delta))))
            .map_err(|e| PeerError::Connect(e.to_string()))?;
        let previous = self.peers.latest.lock().insert(endpoint.to_owned(), Arc::downgrade(&peer));
        // A new epoch on this endpoint makes work prepared for the old one
        // fail (a restarted peer is a new identity).
        if let Some(old) = previous.and_then(|w| w.upgrade()) {
            if old.epoch != peer.epoch {
                old.superseded_by.store(peer.epoch, Ordering::Release);
            }
        }
        let mut all = self.peers.all.lock();
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&peer));
        Ok(RemoteSegment { peer })
    }

    /// The initiator connections, with the first opened peer.
    fn initiators(&self) -> std::io::Result<Arc<Initiators<RouteTask>>> {
        super::get_or_start(&self.peers.initiators, || Ok(Initiators::new(self.reactor()?)))
    }

    /// What this engine may do with a peer proven to run on this host
    /// (the link's local proof), route by route.
    fn same_host(&self, link: &PeerLink<RouteTask>) -> Result<SameHost, LocalError> {
        let cred = link.local.as_ref().map_err(Clone::clone)?;
        let ipc = (self.config.cuda_ipc, &self.counters);
        let mut h = crate::transport::routes::open_same_host(cred.pid, &link.descriptor, ipc);
        if let Some(hooks) = &self.routes.hooks {
            h.cma = hooks.cma_probe(h.cma);
        }
        Ok(h)
    }

    /// Brings `peer`'s view up to date: asks what changed after the
    /// version it has (one round trip per page that fits a frame, bounded
    /// by `peer_timeout_ms` in all) and applies it. Concurrent refreshes of
    /// one peer wait for each other; no lock that posts or polls take is
    /// held meanwhile.
    pub(crate) fn refresh(&self, peer: &Arc<Peer>) -> Result<(), Error> {
        self.refresh_after(peer, None).map(drop)
    }

    /// [`Self::refresh`], unless another refresh finished after the caller
    /// counted `seen` of them (it waited for that one): then it returns
    /// `false` and the caller looks again first.
    fn refresh_after(&self, peer: &Arc<Peer>, seen: Option<u64>) -> Result<bool, Error> {
        if let Some(e) = peer.refusal() {
            return Err(e.into());
        }
        let mut done = peer.refresh_lock.lock();
        if seen.is_some_and(|n| *done > n) && !peer.view_is_behind() {
            return Ok(false);
        }
        *done += 1;
        // What the peer refused before this point, the answer covers.
        peer.link.clear_lapsed();
        let deadline = crate::time::deadline_after(self.config.peer_timeout());
        loop {
            let since = peer.view().version;
            let mut body = Vec::new();
            let req = crate::wire::DescribeSince {
                initiator_epoch: self.epoch,
                expected_epoch: peer.epoch,
                since,
                max_reply: self.config.max_frame_body,
            };
            crate::wire::encode_describe_since(&mut body, &req);
            let reply = self.call_on(&peer.link, deadline, true, |done| {
                PeerJob::Control(ControlJob { kind: Kind::DescribeSince, flags: 0, body, done })
            })?;
            let delta = Delta::decode(&reply).map_err(|e| PeerError::Protocol(e.to_string()))?;
            let more = delta.more;
            // Changes pushed meanwhile may have moved the view: these still
            // apply from `since` (or are older, and ignored).
            if !peer.apply(since, delta) {
                return Err(PeerError::Protocol("the peer's changes do not continue the view".into()).into());
            }
            if !more {
                return Ok(true);
            }
        }
    }

    /// Refreshes `peer`'s view if the peer announced changes it lacks.
    /// A failed refresh leaves the view as it was (what it names stays
    /// checked by the peer itself).
    pub(crate) fn refresh_if_behind(&self, peer: &Arc<Peer>) {
        if peer.view_is_behind() {
            let _ = self.refresh(peer);
        }
    }

    /// The peer's registration covering `[addr, addr + len)` that
    /// `accept`s: the view is refreshed first if the peer announced
    /// changes, and once more if nothing covers the range.
    pub(crate) fn find_remote(
        &self,
        peer: &Arc<Peer>,
        addr: u64,
        len: u64,
        accept: &dyn Fn(&ExportedRegistration) -> bool,
    ) -> Result<ExportedRegistration, Error> {
        self.refresh_if_behind(peer);
        let lookup = || peer.view().find_range(addr, len, accept).cloned();
        // A miss asks the peer once, unless a refresh that finished while
        // this caller waited for it brought the range already (the lock
        // counts the refreshes done).
        let seen = *peer.refresh_lock.lock();
        if let Some(r) = lookup() {
            return Ok(r);
        }
        if !self.refresh_after(peer, Some(seen))? {
            if let Some(r) = lookup() {
                return Ok(r);
            }
            self.refresh_after(peer, None)?;
        }
        lookup().ok_or_else(|| PeerError::RangeNotRegistered { addr, len }.into())
    }

    /// Remote descriptors for ranges named by their address in the peer:
    /// each resolves to a registration covering it with the permission
    /// `op` needs (the view refreshed as in [`Self::find_remote`], at most
    /// once more for the whole list).
    pub(crate) fn resolve_remote(
        &self,
        peer: &Arc<Peer>,
        op: crate::Op,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<crate::Desc>, Error> {
        let allowed = |r: &ExportedRegistration| match op {
            crate::Op::Write => r.permission.remote_write(),
            crate::Op::Read => r.permission.remote_read(),
        };
        self.refresh_if_behind(peer);
        let mut refreshed = false;
        loop {
            let view = peer.view();
            let mut out = Vec::with_capacity(ranges.len());
            let mut last: Option<&ExportedRegistration> = None;
            let mut missing = None;
            for &(addr, len) in ranges {
                let end = addr.checked_add(len);
                let hit = last.filter(|r| r.addr <= addr && end.is_some_and(|e| e <= r.addr + r.len));
                let r = match hit.or_else(|| view.find_range(addr, len, allowed)) {
                    Some(r) => r,
                    None => {
                        missing = Some((addr, len));
                        break;
                    }
                };
                last = Some(r);
                out.push(crate::Desc::new(r.id, addr - r.addr, len));
            }
            match missing {
                None => return Ok(out),
                Some((addr, len)) if refreshed => return Err(PeerError::RangeNotRegistered { addr, len }.into()),
                Some(_) => {
                    drop(view);
                    self.refresh(peer)?;
                    refreshed = true;
                }
            }
        }
    }

    pub(crate) fn close_all_peers(&self, timeout: Duration) {
        let peers: Vec<Arc<Peer>> = self.peers.all.lock().iter().filter_map(|w| w.upgrade()).collect();
        for p in peers {
            let _ = p.close(timeout);
        }
    }

    pub(crate) fn own_endpoint(&self) -> String {
        self.listener.endpoint.get().map(|a| a.endpoint.clone()).unwrap_or_default()
    }

    /// Appends a notification to a same-host peer's inbox; false if the
    /// peer has none mapped or it is full (the caller then uses TCP).
    pub(crate) fn notify_fast(&self, peer: &Peer, payload: &[u8]) -> bool {
        let Some(inbox) = peer.inbox.as_ref() else { return false };
        // A dead peer's inbox may outlive it: never report delivery there.
        if peer.liveness.as_ref().is_some_and(|l| !l.handle().alive()) {
            return false;
        }
        let env = crate::transport::inbox::Envelope {
            sender_epoch: self.epoch,
            target_epoch: peer.epoch,
            sender_endpoint: self.own_endpoint(),
            payload: payload.to_vec(),
        };
        inbox.1.append(&env).is_ok()
    }

    pub(crate) fn check_notification_size(&self, len: usize) -> Result<(), PeerError> {
        let limit = self.config.max_notification_bytes;
        if len as u64 > limit {
            return Err(PeerError::NotificationTooLarge { len: len as u64, limit });
        }
        Ok(())
    }

    /// A notification frame for `peer`, answered through `done`.
    pub(crate) fn notification_job(&self, peer: &Peer, payload: &[u8], done: ControlDone) -> PeerJob<RouteTask> {
        let mut body = Vec::new();
        let own = self.own_endpoint();
        let env = NotifyEnvelope { sender_endpoint: &own, sender_epoch: self.epoch, target_epoch: peer.epoch, payload };
        crate::wire::encode_notify(&mut body, &env);
        PeerJob::Control(ControlJob { kind: Kind::Notify, flags: 0, body, done })
    }

    /// Sends one control frame to `peer` and waits for its answer, at most
    /// `peer_timeout_ms`.
    fn call(&self, peer: &Peer, make: impl FnOnce(ControlDone) -> PeerJob<RouteTask>) -> Result<Vec<u8>, PeerError> {
        self.call_on(&peer.link, crate::time::deadline_after(self.config.peer_timeout()), false, make)
    }

    /// A control call on `link` (a peer's, or one being opened), ahead of
    /// queued data tasks if `first`: the reply's body, or why there is none
    /// by `deadline`. A late answer is dropped; the request is not
    /// repeated.
    fn call_on(
        &self,
        link: &PeerLink<RouteTask>,
        deadline: Instant,
        first: bool,
        make: impl FnOnce(ControlDone) -> PeerJob<RouteTask>,
    ) -> Result<Vec<u8>, PeerError> {
        let slot: Arc<Reply> = Arc::new((Mutex::new(None), Condvar::new()));
        let s2 = slot.clone();
        let job = make(Box::new(move |r| {
            *s2.0.lock() = Some(r.map(<[u8]>::to_vec));
            s2.1.notify_all();
        }));
        if first {
            link.submit_first(job)
        } else {
            link.submit(job)
        }
        let spin_until = Instant::now() + self.config.spin();
        let mut g = slot.0.lock();
        while g.is_none() {
            if Instant::now() < spin_until {
                parking_lot::MutexGuard::unlocked(&mut g, std::hint::spin_loop);
                continue;
            }
            if slot.1.wait_until(&mut g, deadline).timed_out() && g.is_none() {
                return Err(PeerError::Timeout(format!("no answer within {} ms", self.config.peer_timeout_ms)));
            }
        }
        match g.take() {
            Some(Ok(body)) => Ok(body),
            Some(Err(PeerFailure::Lost(why))) => Err(PeerError::Lost(why)),
            Some(Err(PeerFailure::Refused(status, detail))) => Err(PeerError::Refused { status, detail }),
            None => Err(PeerError::Lost("no answer".into())),
        }
    }

    /// Sends a standalone notification: into a same-host peer's inbox, or
    /// over TCP waiting for the peer's answer.
    pub(crate) fn notify(&self, seg: &RemoteSegment, payload: &[u8]) -> Result<(), Error> {
        self.check_notification_size(payload.len())?;
        if let Some(e) = seg.peer.refusal() {
            return Err(e.into());
        }
        if self.notify_fast(&seg.peer, payload) {
            return Ok(());
        }
        self.call(&seg.peer, |done| self.notification_job(&seg.peer, payload, done))?;
        Ok(())
    }

    /// Asks `peer` to keep registrations `ids` alive for a one-sided route
    /// until the returned loan is dropped.
    /// `flags`: how the route reaches them (`RouteImpl::borrow_flags`).
    pub(crate) fn borrow(
        &self,
        peer: &Arc<Peer>,
        ids: &[(u64, u64)],
        write: bool,
        flags: u8,
    ) -> Result<RemoteLoan, PeerError> {
        let id = self.peers.next_borrow.fetch_add(1, Ordering::Relaxed) ^ self.epoch.rotate_left(32);
        let mut body = Vec::new();
        crate::wire::encode_borrow(
            &mut body,
            id,
            peer.epoch,
            ids.iter().map(|&(raw, len)| crate::wire::RemoteDesc { registration: raw, offset: 0, len }),
        );
        let flags = if write { crate::wire::BORROW_WRITE } else { 0 } | flags;
        // Read before asking: a deregistration after this read either makes
        // the peer refuse the borrow or moves the count, so the next post
        // asks again.
        let fences = peer.fences();
        let deadline = crate::time::deadline_after(self.config.peer_timeout());
        self.call_on(&peer.link, deadline, true, |done| {
            PeerJob::Control(ControlJob { kind: Kind::Borrow, flags, body, done })
        })?;
        Ok(RemoteLoan { peer: peer.clone(), id, fences })
    }
}
