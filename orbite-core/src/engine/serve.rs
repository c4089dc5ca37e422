//! The target side this engine offers its peers: what it describes,
//! how a request's descriptors are checked and resolved to registered
//! memory under loans, and where received notifications go.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

use crate::engine::EngineInner;
use crate::engine::notify::Notification;
use crate::registry::Registration;
use crate::segment::{Delta, ExportedRegistration, SegmentDescriptor};
use crate::transport::proto::server::{BorrowLimits, TargetSide, TargetView};
use crate::transport::routes::staging::ServerStage;
use crate::transport::server::Server;
use crate::transport::sock::iov;
use crate::transport::watchers::Watchers;
use crate::types::RegistrationId;
use crate::wire::{Limits, NotifyEnvelope, RemoteStatus, Request};

/// A listening engine's side towards its peers (empty until it listens).
#[derive(Default)]
pub(crate) struct Listener {
    /// What peers dial (set once the listener is bound).
    pub endpoint: OnceLock<crate::endpoint::Advertised>,
    /// Where the listener is bound.
    pub bound: OnceLock<std::net::SocketAddr>,
    /// The local socket same-host peers prove this engine over, if bound.
    pub local_socket: OnceLock<String>,
    pub server: Mutex<Option<Server>>,
    /// Peers watching this engine's registrations.
    pub watchers: OnceLock<Arc<Watchers>>,
    /// The shared secret every peer connection proves (`auth`).
    pub secret: Option<Arc<crate::transport::auth::Secret>>,
    /// Refusals of peers, logged at most once a minute per peer and
    /// reason, each report saying how many it stands for.
    pub refusals: crate::logs::Repeats,
    /// RDMA queue pairs peers' connections hold, per peer address.
    pub rdma_held: Arc<Mutex<std::collections::HashMap<Option<std::net::IpAddr>, usize>>>,
}

/// Queue pairs one peer address may hold on this engine: half of what a
/// NIC holds, so that others keep the rest.
pub(crate) const RDMA_SHARE: usize = crate::verbs::rails::MAX_QPS as usize / 2;

/// Queue pairs a connection holds, counted against its address's share
/// until it goes.
pub(crate) struct RdmaShare {
    held: Arc<Mutex<std::collections::HashMap<Option<std::net::IpAddr>, usize>>>,
    from: Option<std::net::IpAddr>,
    n: usize,
}

impl Drop for RdmaShare {
    fn drop(&mut self) {
        let mut held = self.held.lock();
        if let Some(c) = held.get_mut(&self.from) {
            *c = c.saturating_sub(self.n);
            if *c == 0 {
                held.remove(&self.from);
            }
        }
    }
}

impl Listener {
    /// Counts `n` queue pairs against `from`'s share, or refuses.
    fn rdma_share(&self, from: Option<std::net::IpAddr>, n: usize) -> Result<RdmaShare, (RemoteStatus, String)> {
        let mut held = self.rdma_held.lock();
        let now = held.get(&from).copied().unwrap_or(0);
        if now + n > RDMA_SHARE {
            return Err((
                RemoteStatus::ResourceExhausted,
                format!("this address holds {now} RDMA queue pairs here; {RDMA_SHARE} is its share"),
            ));
        }
        held.insert(from, now + n);
        Ok(RdmaShare { held: self.rdma_held.clone(), from, n })
    }
}

impl TargetView for EngineInner {
    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn registry_version(&self) -> u64 {
        self.registry.lock().version()
    }

    fn changes(&self, since: u64, budget: usize) -> Delta {
        let c = self.registry.lock().changes_since(since, budget, ExportedRegistration::of, crate::segment::entry_len);
        Delta { version: c.version, reset: c.reset, more: c.more, removed: c.removed, added: c.added }
    }

    fn descriptor(&self) -> Vec<u8> {
        self.segment_descriptor().to_bytes()
    }

    fn rdma_connect(
        &self,
        from: Option<std::net::IpAddr>,
        cards: &[crate::wire::QpCard],
    ) -> Result<(Vec<crate::wire::QpCard>, Box<dyn std::any::Any + Send>), (RemoteStatus, String)> {
        if self.routes.rails.rails().is_empty() {
            let why = self.routes.rails.why().unwrap_or("no RDMA NIC");
            return Err((RemoteStatus::Other, format!("this engine has no RDMA NIC: {why}")));
        }
        // One address holds at most its share of the NICs' queue pairs, so
        // no peer can take them all from the others.
        let share = self.listener.rdma_share(from, cards.len())?;
        let (mine, links) = crate::transport::routes::rdma::accept(&self.routes.rails, cards)
            .map_err(|why| (RemoteStatus::ResourceExhausted, why))?;
        Ok((mine, Box::new((links, share))))
    }

    fn resolve(
        &self,
        req: &Request<'_>,
        write: bool,
        iovs: &mut Vec<libc::iovec>,
        loans: &mut Vec<Arc<Registration>>,
    ) -> Result<(), (RemoteStatus, String)> {
        self.resolve_with(req, write, iovs, loans, None)
    }

    fn resolve_staged(
        &self,
        req: &Request<'_>,
        write: bool,
        iovs: &mut Vec<libc::iovec>,
        loans: &mut Vec<Arc<Registration>>,
        landing: &mut Option<Box<dyn crate::transport::proto::server::Landing>>,
    ) -> Result<(), (RemoteStatus, String)> {
        self.resolve_with(req, write, iovs, loans, Some(landing))
    }

    fn limits(&self) -> Limits {
        self.frame_limits()
    }

    fn responder(&self, at: crate::transport::proto::server::ConnEnd) -> crate::transport::auth::ResponderSelf {
        use crate::transport::proto::server::ConnEnd;
        crate::transport::auth::ResponderSelf {
            epoch: self.epoch,
            advertised: self.listener.endpoint.get().map(|a| a.endpoint.clone()),
            local_socket: self.listener.local_socket.get().cloned(),
            reached_at: match at {
                ConnEnd::Tcp(a) => Some(a),
                ConnEnd::Local => None,
            },
        }
    }

    fn borrow_limits(&self) -> BorrowLimits {
        let c = &self.config;
        BorrowLimits {
            per_connection: usize::try_from(c.max_borrows_per_connection).unwrap_or(usize::MAX),
            registrations_per_borrow: usize::try_from(c.max_registrations_per_borrow).unwrap_or(usize::MAX),
        }
    }

    fn lend_rdma(
        &self,
        req: &Request<'_>,
        write: bool,
        loans: &mut Vec<Arc<Registration>>,
    ) -> Result<(), (RemoteStatus, String)> {
        // Ranges with a memory region: what the borrower's requests reach
        // through its rkeys.
        self.lend(req, write, loans, |r| r.rdma.any(), |_, _| {})
    }

    fn lend_device(
        &self,
        req: &Request<'_>,
        write: bool,
        loans: &mut Vec<Arc<Registration>>,
    ) -> Result<(), (RemoteStatus, String)> {
        if !self.config.cuda_ipc {
            return Err((RemoteStatus::PermissionDenied, "CUDA IPC is off on this target (cuda_ipc)".into()));
        }
        // Device memory only: what the borrower opened through IPC.
        self.lend(req, write, loans, |r| !r.is_host(), |_, _| {})
    }
}

impl EngineInner {
    /// A peer's notification into the queue, or why not.
    fn deliver_checked(&self, env: &NotifyEnvelope<'_>) -> Result<(), (RemoteStatus, String)> {
        if env.payload.len() as u64 > self.config.max_notification_bytes {
            return Err((RemoteStatus::NotificationTooLarge, format!("limit {}", self.config.max_notification_bytes)));
        }
        if env.sender_endpoint.len() > crate::engine::notify::MAX_SENDER_ENDPOINT {
            let limit = crate::engine::notify::MAX_SENDER_ENDPOINT;
            return Err((RemoteStatus::BadLength, format!("a sender endpoint may have {limit} bytes")));
        }
        // A sender we know under another epoch is a stale (or future)
        // identity: refuse rather than attribute it wrongly.
        let known = self.peers.latest.lock().get(env.sender_endpoint).and_then(|w| w.upgrade()).map(|p| p.epoch);
        if let Some(epoch) = known {
            if epoch != env.sender_epoch {
                return Err((RemoteStatus::EpochMismatch, format!("sender epoch is {epoch:#x}")));
            }
        }
        let n = Notification {
            sender_endpoint: env.sender_endpoint.to_owned(),
            sender_epoch: env.sender_epoch,
            payload: env.payload.to_vec(),
        };
        self.enqueue_notification(n).map_err(|e| (RemoteStatus::ResourceExhausted, e.to_string()))
    }

    /// Loans on every range `req` names (checked by `checked_range`, each
    /// registration also passing `lendable`), each range also handed to
    /// `each` with its registration (a borrow of a route that reaches the
    /// ranges itself needs nothing more; `resolve` makes I/O vectors).
    fn lend(
        &self,
        req: &Request<'_>,
        write: bool,
        loans: &mut Vec<Arc<Registration>>,
        lendable: impl Fn(&Registration) -> bool,
        mut each: impl FnMut(crate::wire::RemoteDesc, &Registration),
    ) -> Result<(), (RemoteStatus, String)> {
        if self.is_closed() {
            return Err((RemoteStatus::Closing, "engine is closing".into()));
        }
        let table = self.registry.lock();
        for d in req.descs() {
            let reg = checked_range(&table, d, write, &lendable)?;
            each(d, reg);
            if !loans.last().is_some_and(|l| Arc::ptr_eq(l, reg)) {
                loans.push(reg.clone());
            }
        }
        Ok(())
    }
}

impl TargetSide for EngineInner {
    fn view(&self) -> &dyn TargetView {
        self
    }

    fn deliver(&self, env: &NotifyEnvelope<'_>) -> Result<(), (RemoteStatus, String)> {
        let r = self.deliver_checked(env);
        if r.is_err() {
            self.metrics.notifications_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        r
    }

    fn auth_failed(&self, from: &str, why: &str) {
        self.note_auth_failure(from, &format!("did not authenticate: {why}"));
    }

    fn connection_refused(&self, from: &str, why: &str) {
        self.counters.connections_refused.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.log_refusal(
            crate::logs::SERVER,
            &format!("{from} {why}"),
            &format!("a connection from {from} was closed at accept: {why} is full"),
        );
    }

    fn connection_broke(&self, from: &str, why: &str) {
        self.log_refusal(
            crate::logs::SERVER,
            &format!("{from} broke"),
            &format!("a connection from {from} was closed: it broke the protocol ({why})"),
        );
    }

    fn shared_fd(&self, name: &str) -> Option<std::os::fd::OwnedFd> {
        if let Some((inbox, _)) = self.notifications.inbox.get() {
            if inbox.shared_name() == Some(name) {
                return inbox.shared_fd()?.try_clone_to_owned().ok();
            }
        }
        self.registry.lock().shared_fd(name)
    }

    fn ipc_export(&self, ids: &[u64]) -> (Vec<crate::wire::IpcEntry>, Vec<std::os::fd::OwnedFd>) {
        use crate::wire::IpcEntry;
        let refused = |why: &str| IpcEntry::Refused(why.to_owned());
        if !self.config.cuda_ipc {
            return (ids.iter().map(|_| refused("CUDA IPC is off on this target (cuda_ipc)")).collect(), Vec::new());
        }
        // (device, address, length) of live, remotely reachable device
        // registrations; the driver is asked outside the registry lock.
        // A registration that is not is answered with its refusal.
        let found: Vec<Result<(u32, u64, u64), IpcEntry>> = {
            let table = self.registry.lock();
            ids.iter()
                .map(|&raw| {
                    let id = RegistrationId::from_raw(raw);
                    let reg = table.get(id).map_err(|e| refused(&e.to_string()))?;
                    let reachable = reg.permission.remote_read() || reg.permission.remote_write();
                    match reg.kind {
                        crate::memory::MemoryKind::Cuda { device } if reachable && !reg.is_fenced() => {
                            Ok((device, reg.base as u64, reg.len))
                        }
                        crate::memory::MemoryKind::Cuda { .. } => Err(refused(&format!("{id} is not open to peers"))),
                        _ => Err(refused(&format!("{id} is not CUDA device memory"))),
                    }
                })
                .collect()
        };
        // Descriptors go with shareable entries (feature cuda), one each.
        let mut fds = Vec::new();
        let mut entries = found
            .into_iter()
            .map(|f| match f {
                Err(entry) => entry,
                Ok((device, addr, len)) => match crate::cuda::ipc_export(device, addr, len) {
                    Ok(x) => match x.handle {
                        crate::cuda::IpcHandle::Legacy(handle) => IpcEntry::Exported {
                            uuid: x.uuid,
                            handle,
                            offset: addr - x.alloc_base,
                            alloc_len: x.alloc_len,
                        },
                        crate::cuda::IpcHandle::Shareable(_) if fds.len() == crate::wire::MAX_SHARED_FDS => {
                            refused("too many descriptors for one answer: ask again for this one")
                        }
                        crate::cuda::IpcHandle::Shareable(fd) => {
                            fds.push(fd);
                            IpcEntry::Shareable {
                                uuid: x.uuid,
                                alloc_base: x.alloc_base,
                                offset: addr - x.alloc_base,
                                alloc_len: x.alloc_len,
                            }
                        }
                    },
                    Err(why) => refused(&why.to_string()),
                },
            })
            .collect::<Vec<_>>();
        debug_assert_eq!(fds.len(), entries.iter().filter(|e| e.has_fd()).count());
        if let Some(h) = &self.routes.hooks {
            h.ipc_answer(&mut entries, &mut fds);
        }
        (entries, fds)
    }

    fn remote_gate(&self) {
        if let Some(h) = &self.routes.hooks {
            h.before_remote_bytes();
        }
    }

    fn pushes_withheld(&self) -> bool {
        self.routes.hooks.as_ref().is_some_and(|h| h.pushes_withheld())
    }
}

/// The live registration a peer's descriptor `d` names, if the access
/// (`write` or read), the fence, `reachable` and the bounds (checked
/// arithmetic) allow it.
fn checked_range(
    table: &crate::registry::Table,
    d: crate::wire::RemoteDesc,
    write: bool,
    reachable: impl Fn(&Registration) -> bool,
) -> Result<&Arc<Registration>, (RemoteStatus, String)> {
    let id = RegistrationId::from_raw(d.registration);
    let reg = table.get(id).map_err(|e| match e {
        crate::RegistryError::Unknown(_) => (RemoteStatus::UnknownRegistration, e.to_string()),
        _ => (RemoteStatus::StaleRegistration, e.to_string()),
    })?;
    let allowed = if write { reg.permission.remote_write() } else { reg.permission.remote_read() };
    if !allowed || reg.is_fenced() || !reachable(reg) {
        return Err((RemoteStatus::PermissionDenied, format!("{id} does not permit this access")));
    }
    match d.offset.checked_add(d.len) {
        Some(end) if end <= reg.len && d.len > 0 => Ok(reg),
        _ => Err((RemoteStatus::OutOfBounds, format!("{}+{} outside {id}", d.offset, d.len))),
    }
}

impl EngineInner {
    /// Resolves a peer's request into I/O vectors and loans. With
    /// `landing` (a WRITE or READ, not a borrow), device memory is staged
    /// through a buffer of the staging pool (feature `cuda`); without it,
    /// device memory is refused.
    fn resolve_with(
        &self,
        req: &Request<'_>,
        write: bool,
        iovs: &mut Vec<libc::iovec>,
        loans: &mut Vec<Arc<Registration>>,
        landing: Option<&mut Option<Box<dyn crate::transport::proto::server::Landing>>>,
    ) -> Result<(), (RemoteStatus, String)> {
        let staging = landing.is_some();
        // (iovec index, device address, bytes, device) of device ranges.
        let mut device_ranges: Vec<(usize, u64, u64, u32)> = Vec::new();
        // Device memory only where this target stages it.
        self.lend(
            req,
            write,
            loans,
            |r| r.is_host() || staging,
            |d, reg| {
                if let crate::memory::MemoryKind::Cuda { device } = reg.kind {
                    device_ranges.push((iovs.len(), reg.base as u64 + d.offset, d.len, device));
                }
                iovs.push(iov(reg.base as u64 + d.offset, d.len));
            },
        )?;
        if let Some(landing) = landing {
            let pool = &self.routes.staging_pool;
            *landing = ServerStage::stage(pool, write, iovs, &device_ranges, self.config.task_bytes)
                .map_err(|why| (RemoteStatus::ResourceExhausted, format!("no staging buffer: {why}")))?;
        }
        Ok(())
    }

    /// Counts a failed authentication with peer `who`, and logs it once
    /// per peer.
    pub(crate) fn note_auth_failure(&self, who: &str, what: &str) {
        self.counters.auth_failures.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.log_refusal(crate::logs::AUTH, &format!("{who} auth"), &format!("peer {who} {what}"));
    }

    /// Logs a refusal of a peer under `target`, rate-limited per `key`
    /// (one report a minute at most, saying how many it stands for): a peer
    /// that repeats it is counted, and cannot flood the log.
    pub(crate) fn log_refusal(&self, target: &str, key: &str, what: &str) {
        if let Some(n) = self.listener.refusals.admit(key, std::time::Instant::now()) {
            let also = crate::logs::standing_for(n, crate::logs::WINDOW);
            log::warn!(target: target, "engine {:#x}: {what}{also}", self.epoch);
        }
    }

    /// What the listener accepts, and how long it waits for a peer.
    pub(crate) fn server_limits(&self) -> crate::transport::server::ServerLimits {
        let c = &self.config;
        let count = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        crate::transport::server::ServerLimits {
            max_connections: count(c.max_connections),
            per_address: count(c.max_connections_per_address),
            frame_timeout: Duration::from_millis(c.server_frame_timeout_ms),
            unauthenticated: count(c.max_unauthenticated_connections),
            idle_timeout: (c.server_idle_timeout_ms > 0).then(|| Duration::from_millis(c.server_idle_timeout_ms)),
            min_rate: c.peer_min_bytes_per_s,
            window: c.tcp_window(),
            watchers: crate::transport::watchers::WatcherLimits {
                total: count(c.max_watchers),
                per_address: count(c.max_watchers_per_address),
            },
        }
    }

    /// What the listener's connections may make this engine hold.
    pub(crate) fn server_budget(&self) -> crate::transport::proto::server::ServerBudget {
        let c = &self.config;
        crate::transport::proto::server::ServerBudget {
            counters: self.counters.clone(),
            frame_buffer_bytes: c.max_frame_buffer_bytes,
            borrows: c.max_borrows,
            borrow_bytes: c.max_borrow_bytes,
        }
    }

    pub(crate) fn segment_descriptor(&self) -> SegmentDescriptor {
        let (registrations, registry_version) = self.registry.lock().exported(ExportedRegistration::of);
        SegmentDescriptor {
            rdma_nics: self.routes.rails.rails().len() as u8,
            endpoint: self.own_endpoint(),
            epoch: self.epoch,
            registry_version,
            pid: std::process::id(),
            boot_id: self.boot_id,
            inbox: self.notifications.inbox.get().and_then(|(m, _)| m.shared_name()).unwrap_or_default().to_owned(),
            local_socket: self.listener.local_socket.get().cloned().unwrap_or_default(),
            registrations,
        }
    }
}
