//! An engine's RDMA NICs ("rails") and what the RDMA route does with them.
//!
//! Each NIC the engine uses is opened once, with one protection domain
//! (every region and queue pair of the engine on that NIC lives in it) and
//! one completion queue that every queue pair of the NIC completes into.
//! A poller thread per NIC drains that queue: it spins for `spin` after
//! the last completion, then sleeps on the completion channel, so an idle
//! engine spends no CPU on it. A worker waiting for its task polls too
//! while it spins, so a short task needs no thread hand-off.
//!
//! A task is posted as chains of work requests on one queue pair, the
//! last request of each chain signaled ([`QpLink::post`]). Its requests'
//! ids carry the task's token and their index, so an error completion
//! says exactly which request failed; the task is done when the last
//! request of every chain has completed (with success, an error, or a
//! flush), never before. An error completion moves its queue pair to ERR
//! (every later request of it is flushed) and marks the link broken.
//!
//! The queue sizes are fixed: `QP_DEPTH` send requests per queue pair, and
//! a completion queue with room for every request of `MAX_QPS` queue
//! pairs, so it cannot overrun (a request in error always completes, even
//! unsignaled).

use std::collections::HashMap;
use std::net::Ipv6Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::VerbsError;
use super::loader::Library;
use super::objects::{Completion, Cq, Device, Mr, Pd, Qp, RemoteQp, Sge, Verb, WorkRequest, access, status};

/// Send requests one queue pair holds.
pub(crate) const QP_DEPTH: u32 = 512;
/// Queue pairs one NIC of an engine holds (initiator and target sides).
pub(crate) const MAX_QPS: u32 = 256;
/// Requests of a chain: the chain's last one is signaled, and a task
/// waits for room on its queue pair for each chain.
const CHAIN: usize = 128;
/// The completion status of a request the peer never answered.
pub(crate) const RETRY_EXCEEDED: i32 = status::RETRY_EXC_ERR;
/// Largest message of one request (real NICs take up to 2 GiB).
const MAX_MESSAGE: u64 = 1 << 30;

/// Which NICs an engine uses, and how.
#[derive(Debug, Clone)]
pub(crate) struct RailChoice {
    /// `rdma_devices`: `None`, every NIC with an active port; a list,
    /// those NICs (each must have an active port).
    pub devices: Option<Vec<String>>,
    /// `rdma_gid_index`: the GID each port sends from (`None`: IPv4
    /// RoCE v2 first, as [`super::NicPort::default_gid`] picks).
    pub gid_index: Option<u32>,
    /// How long pollers spin after a completion before sleeping.
    pub spin: Duration,
}

/// The NICs an engine opened, or why it has none.
pub(crate) struct Rails {
    rails: Vec<Arc<Rail>>,
    /// Why there is no NIC (or why one asked for is missing).
    why: Option<String>,
}

impl Rails {
    /// No NIC, for `why`.
    pub fn none(why: impl Into<String>) -> Rails {
        Rails { rails: Vec::new(), why: Some(why.into()) }
    }

    /// Opens the NICs `choice` names, from the process's verbs library.
    pub fn open(choice: &RailChoice) -> Rails {
        if choice.devices.as_ref().is_some_and(Vec::is_empty) {
            return Rails::none("RDMA is off (rdma_devices is empty)");
        }
        match super::loader::get() {
            Ok(lib) => Rails::open_in(lib, choice),
            Err(e) => Rails::none(e.to_string()),
        }
    }

    /// Opens the NICs `choice` names, of `lib`.
    pub(super) fn open_in(lib: &'static Library, choice: &RailChoice) -> Rails {
        let nics = match super::loader::nics(lib) {
            Ok(n) => n,
            Err(e) => return Rails::none(e.to_string()),
        };
        let mut rails = Vec::new();
        let mut why = Vec::new();
        if let Some(names) = &choice.devices {
            for n in names.iter().filter(|n| !nics.iter().any(|nic| &nic.name == *n)) {
                why.push(format!("{n}: no such NIC"));
            }
        }
        for nic in &nics {
            let named = choice.devices.as_ref().is_some_and(|d| d.contains(&nic.name));
            if choice.devices.is_some() && !named {
                continue;
            }
            let Some(port) = nic.ports.iter().find(|p| p.state == super::PortState::Active) else {
                if named {
                    why.push(format!("{}: no active port", nic.name));
                }
                continue;
            };
            let gid = match choice.gid_index {
                Some(i) => port.gids.iter().find(|g| g.index == i),
                None => port.default_gid(),
            };
            let Some(gid) = gid else {
                why.push(format!("{} port {}: no usable GID", nic.name, port.port));
                continue;
            };
            let index = rails.len() as u8;
            match Rail::open(lib, index, nic, port.port, gid, port.active_mtu, choice.spin) {
                Ok(r) => rails.push(r),
                Err(e) => why.push(format!("{}: {e}", nic.name)),
            }
            if rails.len() == u8::MAX as usize {
                break;
            }
        }
        if rails.is_empty() && why.is_empty() {
            why.push("no RDMA NIC with an active port".into());
        }
        Rails { rails, why: (!why.is_empty()).then(|| why.join("; ")) }
    }

    /// The NICs, in index order.
    pub fn rails(&self) -> &[Arc<Rail>] {
        &self.rails
    }

    /// Why there is no NIC, or why one asked for is not used.
    pub fn why(&self) -> Option<&str> {
        self.why.as_deref()
    }

    /// Registers `[addr, addr + len)` on every NIC, allowing peers what
    /// `remote` says: a region per NIC, or why not.
    ///
    /// # Safety
    /// The range is memory of this process that stays valid until the
    /// regions are dropped (NICs, and peers holding their rkeys, may touch
    /// it until then).
    pub unsafe fn register(&self, addr: u64, len: u64, remote: Remote) -> Regions {
        let flags = access::LOCAL_WRITE
            | match remote {
                Remote::None => 0,
                Remote::Read => access::REMOTE_READ,
                Remote::ReadWrite => access::REMOTE_READ | access::REMOTE_WRITE,
            };
        // SAFETY: per the contract.
        Regions { regions: self.rails.iter().map(|r| unsafe { r.pd.register(addr, len, flags) }).collect(), via: None }
    }

    /// Registers CUDA device memory `[addr, addr + len)` on every NIC
    /// (GPUDirect RDMA): through its dma-buf export `dmabuf` (a descriptor
    /// and the range's offset in it) where the NIC takes dma-buf, else by
    /// address where nvidia-peermem is loaded; a NIC with neither has no
    /// region (the route then stages the memory), and the regions say why.
    ///
    /// # Safety
    /// As for [`Rails::register`], for the device memory.
    pub unsafe fn register_device(
        &self,
        addr: u64,
        len: u64,
        remote: Remote,
        dmabuf: Result<(std::os::fd::BorrowedFd<'_>, u64), String>,
    ) -> Regions {
        let flags = access::LOCAL_WRITE
            | match remote {
                Remote::None => 0,
                Remote::Read => access::REMOTE_READ,
                Remote::ReadWrite => access::REMOTE_READ | access::REMOTE_WRITE,
            };
        let peermem = super::peermem_loaded();
        let mut via = None;
        let regions = self
            .rails
            .iter()
            .map(|r| match &dmabuf {
                Ok((fd, offset)) if r.pd.dmabuf_supported() => {
                    via = Some(GpuDirect::DmaBuf);
                    // SAFETY: per the contract; the registration keeps the
                    // allocation until the region is dropped.
                    unsafe { r.pd.register_dmabuf(*fd, *offset, len, addr, flags) }
                }
                _ if peermem => {
                    via = via.or(Some(GpuDirect::PeerMem));
                    // SAFETY: as above; nvidia-peermem resolves the device
                    // pages.
                    unsafe { r.pd.register(addr, len, flags) }
                }
                Ok(_) => Err(VerbsError::Call {
                    call: "ibv_reg_dmabuf_mr",
                    reason: format!("{} takes no dma-buf and nvidia-peermem is not loaded", r.name),
                }),
                Err(why) => Err(VerbsError::Call {
                    call: "cuMemGetHandleForAddressRange",
                    reason: format!("no dma-buf of the memory ({why}) and nvidia-peermem is not loaded"),
                }),
            })
            .collect();
        Regions { regions, via }
    }
}

/// How a NIC reaches CUDA device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GpuDirect {
    /// A region of the memory's dma-buf export.
    DmaBuf,
    /// A region by address, resolved by nvidia-peermem.
    PeerMem,
}

impl GpuDirect {
    pub fn name(self) -> &'static str {
        match self {
            GpuDirect::DmaBuf => "dma-buf",
            GpuDirect::PeerMem => "nvidia-peermem",
        }
    }
}

/// What peers may do with a registered range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Remote {
    None,
    Read,
    ReadWrite,
}

/// A registered range's region on each NIC of its engine (by rail index),
/// or why it has none there. Dropping it deregisters them.
#[derive(Default)]
pub(crate) struct Regions {
    regions: Vec<Result<Mr, VerbsError>>,
    /// For device memory: how the NICs reach it.
    via: Option<GpuDirect>,
}

impl Regions {
    /// The rkey of each NIC's region (`None`: no region there).
    pub fn rkeys(&self) -> Vec<Option<u32>> {
        self.regions.iter().map(|r| r.as_ref().ok().map(|m| m.rkey)).collect()
    }

    /// The lkey of each NIC's region (`None`: no region there).
    pub fn lkeys(&self) -> Vec<Option<u32>> {
        self.regions.iter().map(|r| r.as_ref().ok().map(|m| m.lkey)).collect()
    }

    /// For device memory, how the NICs reach it (`None`: they do not).
    pub fn gpudirect(&self) -> Option<GpuDirect> {
        self.via
    }

    /// Whether a NIC has a region of it.
    pub fn any(&self) -> bool {
        self.regions.iter().any(Result::is_ok)
    }

    /// Why NIC `rail` has no region (`None`: it has one).
    pub fn why_not(&self, rail: u8) -> Option<String> {
        self.lkey(rail).err().map(|e| e.to_string())
    }

    /// The lkey of NIC `rail`'s region.
    pub fn lkey(&self, rail: u8) -> Result<u32, &VerbsError> {
        match self.regions.get(rail as usize) {
            Some(Ok(m)) => Ok(m.lkey),
            Some(Err(e)) => Err(e),
            None => Err(&NO_REGION),
        }
    }
}

static NO_REGION: VerbsError = VerbsError::NotBuilt;

/// One NIC of an engine: its port and GID, its protection domain, and its
/// completion queue with the poller that drains it.
pub(crate) struct Rail {
    /// Its index among the engine's NICs (the order rkeys are listed in).
    pub index: u8,
    pub name: String,
    pub port: u8,
    /// The GID connections send from, and its index.
    pub gid: Ipv6Addr,
    pub gid_index: u8,
    /// The port's active MTU, in bytes.
    pub mtu: u32,
    /// Where it is, for choosing the NIC closest to a buffer.
    pub numa_node: Option<u32>,
    pub pci_path: Option<std::path::PathBuf>,
    pd: Arc<Pd>,
    hub: Arc<Hub>,
    poller: Mutex<Option<std::thread::JoinHandle<()>>>,
    qps: AtomicU32,
}

impl Rail {
    fn open(
        lib: &'static Library,
        index: u8,
        nic: &super::Nic,
        port: u8,
        gid: &super::Gid,
        mtu: u32,
        spin: Duration,
    ) -> Result<Arc<Rail>, VerbsError> {
        let dev = Device::open_in(lib, &nic.name)?;
        let pd = dev.alloc_pd()?;
        let cq = dev.create_cq(QP_DEPTH * MAX_QPS)?;
        // SAFETY: plain eventfd creation.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(VerbsError::Call { call: "eventfd", reason: std::io::Error::last_os_error().to_string() });
        }
        // SAFETY: a fresh descriptor this value owns.
        let wake = unsafe { OwnedFd::from_raw_fd(wake) };
        let hub = Arc::new(Hub {
            dev,
            port,
            port_down: AtomicBool::new(false),
            cq,
            polling: Mutex::new(()),
            tasks: Mutex::new(Tasks { next: 1, live: HashMap::new() }),
            links: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            wake,
            spin,
        });
        Ok(Arc::new(Rail {
            index,
            name: nic.name.clone(),
            port,
            gid: gid.gid,
            gid_index: u8::try_from(gid.index).unwrap_or(u8::MAX),
            mtu,
            numa_node: nic.numa_node,
            pci_path: nic.pci_path.clone(),
            pd,
            hub,
            poller: Mutex::new(None),
            qps: AtomicU32::new(0),
        }))
    }

    /// How far it is from memory at `place`: the ordering key of
    /// [`super::closest`] (PCI hops, then off the memory's NUMA node).
    pub fn distance(&self, place: &super::Place) -> (u32, bool) {
        let (hops, same_numa) = place.distance(self.numa_node, self.pci_path.as_deref());
        (hops.unwrap_or(u32::MAX), !same_numa)
    }

    /// Whether it takes new tasks: not while its port is down (its
    /// device's async events say so).
    pub fn usable(&self) -> bool {
        !self.hub.port_down.load(Ordering::Acquire)
    }

    /// A queue pair of this NIC in INIT, allowing peers `remote` access,
    /// with a fresh packet sequence number: what [`QpLink::connect`]
    /// connects. Refused beyond `MAX_QPS` on the NIC.
    pub fn queue_pair(self: &Arc<Self>, remote: Remote) -> Result<Arc<QpLink>, VerbsError> {
        let taken = self.qps.fetch_add(1, Ordering::AcqRel);
        let slot = QpSlot(self.clone());
        if taken >= MAX_QPS {
            return Err(VerbsError::Call {
                call: "ibv_create_qp",
                reason: format!("{}: all {MAX_QPS} queue pairs of this NIC are in use", self.name),
            });
        }
        let qp = self.pd.create_qp(&self.hub.cq, QP_DEPTH)?;
        let flags = match remote {
            Remote::None => access::LOCAL_WRITE,
            Remote::Read => access::LOCAL_WRITE | access::REMOTE_READ,
            Remote::ReadWrite => access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_WRITE,
        };
        qp.to_init(self.port, flags)?;
        let psn = fresh_psn();
        let link = Arc::new(QpLink {
            qp,
            psn,
            room: Mutex::new(QP_DEPTH),
            room_cv: Condvar::new(),
            broken: AtomicBool::new(false),
            hub: self.hub.clone(),
            _slot: slot,
        });
        self.hub.links.lock().insert(link.qp.qpn, Arc::downgrade(&link));
        self.start_poller();
        Ok(link)
    }

    /// What a peer needs to connect to queue pair `link` of this NIC.
    pub fn card(&self, link: &QpLink) -> Card {
        Card { gid: self.gid, qpn: link.qp.qpn, psn: link.psn, mtu: self.mtu }
    }

    fn start_poller(&self) {
        let mut p = self.poller.lock();
        if p.is_some() {
            return;
        }
        let hub = self.hub.clone();
        let name = format!("orbite-rdma-{}", self.name);
        *p = std::thread::Builder::new().name(name).spawn(move || hub.run()).ok();
    }
}

impl Drop for Rail {
    fn drop(&mut self) {
        self.hub.stop.store(true, Ordering::Release);
        let one = 1u64;
        // SAFETY: 8 bytes into the hub's own eventfd.
        unsafe { libc::write(self.hub.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(t) = self.poller.lock().take() {
            let _ = t.join();
        }
    }
}

/// A queue pair counted against its NIC's `MAX_QPS` until it goes.
struct QpSlot(Arc<Rail>);

impl Drop for QpSlot {
    fn drop(&mut self) {
        self.0.qps.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A fresh 24-bit packet sequence number.
fn fresh_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    (h.finish() as u32) & 0xff_ffff
}

/// What a peer needs to connect to one queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Card {
    pub gid: Ipv6Addr,
    pub qpn: u32,
    pub psn: u32,
    /// The port's MTU, in bytes.
    pub mtu: u32,
}

/// One connected (or connecting) queue pair of a NIC: where tasks are
/// posted, with the room left in its send queue.
pub(crate) struct QpLink {
    qp: Qp,
    psn: u32,
    /// Send requests it may still take.
    room: Mutex<u32>,
    room_cv: Condvar,
    broken: AtomicBool,
    hub: Arc<Hub>,
    _slot: QpSlot,
}

impl QpLink {
    /// Connects it to the remote queue pair `remote` (INIT to RTR to RTS),
    /// over NIC `rail`.
    pub fn connect(&self, rail: &Rail, remote: &Card) -> Result<(), VerbsError> {
        let mtu = rail.mtu.min(remote.mtu);
        self.qp.to_rtr(
            RemoteQp { gid: remote.gid, qpn: remote.qpn, psn: remote.psn },
            rail.port,
            rail.gid_index,
            mtu,
        )?;
        self.qp.to_rts(self.psn)
    }

    /// Whether an error completion broke it (it is in ERR; the next open
    /// of its peer makes new ones).
    pub fn broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Moves it to ERR (once), for `why`: every request outstanding
    /// completes, flushed.
    pub fn fail(&self, why: &str) {
        if !self.broken.swap(true, Ordering::AcqRel) {
            log::warn!(target: crate::logs::RDMA, "queue pair {} on {} failed: {why}", self.qp.qpn, self.hub.dev.name);
            let _ = self.qp.to_error();
        }
    }

    /// Posts one task's requests, `ops` (each an operation on a remote
    /// range and one local range), as chains whose last request is
    /// signaled, waiting (at most until `deadline`) for room in the send
    /// queue. The task's completion is [`Pending::wait`]'s.
    pub fn post(self: &Arc<Self>, ops: &[Op], deadline: Instant) -> Pending {
        let n = ops.len();
        let chains = n.div_ceil(CHAIN);
        let task = Arc::new(TaskState {
            requests: n as u32,
            link: Arc::downgrade(self),
            left: AtomicU32::new(chains as u32),
            failed: Mutex::new(None),
            done: Mutex::new(n == 0),
            cv: Condvar::new(),
        });
        let token = self.hub.tasks.lock().insert(task.clone());
        let mut pending = Pending { task, token, hub: self.hub.clone(), link: self.clone() };
        for (c, chunk) in ops.chunks(CHAIN).enumerate() {
            let first = c * CHAIN;
            if !self.take_room(chunk.len() as u32, deadline) {
                pending.abandon(first as u32, status::RETRY_EXC_ERR, chains - c);
                return pending;
            }
            let wrs: Vec<WorkRequest> = chunk
                .iter()
                .enumerate()
                .map(|(i, o)| WorkRequest {
                    id: (u64::from(pending.token) << 32) | (first + i) as u64,
                    verb: o.verb,
                    local: o.local,
                    signaled: i + 1 == chunk.len(),
                })
                .collect();
            if let Err((at, _)) = self.qp.post(&wrs) {
                // Refused by the library (never for want of room, which
                // was taken above): the link is failed, so what was posted
                // of this chain is flushed; this chain and the ones after
                // it end here.
                self.give_room(chunk.len() as u32);
                self.fail("the library refused a post");
                pending.abandon((first + at) as u32, status::WR_FLUSH_ERR, chains - c);
                return pending;
            }
        }
        pending
    }

    fn take_room(&self, n: u32, deadline: Instant) -> bool {
        let mut room = self.room.lock();
        while *room < n {
            if self.broken() || self.room_cv.wait_until(&mut room, deadline).timed_out() && *room < n {
                return false;
            }
        }
        *room -= n;
        true
    }

    fn give_room(&self, n: u32) {
        *self.room.lock() += n;
        self.room_cv.notify_all();
    }
}

impl Drop for QpLink {
    fn drop(&mut self) {
        // Before its number can be reused (the queue pair is destroyed
        // after this, with the fields).
        self.hub.links.lock().remove(&self.qp.qpn);
    }
}

/// One request of a task: its verb, and the local range it reads or
/// fills.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Op {
    pub verb: Verb,
    pub local: Sge,
}

impl Op {
    /// The requests moving `len` bytes between local `addr` (key `lkey`)
    /// and remote `remote` (key `rkey`), each at most `MAX_MESSAGE`.
    pub fn split(read: bool, addr: u64, lkey: u32, remote: u64, rkey: u32, len: u64, out: &mut Vec<Op>) {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(MAX_MESSAGE);
            let remote_addr = remote + at;
            let verb = if read { Verb::Read { remote_addr, rkey } } else { Verb::Write { remote_addr, rkey } };
            out.push(Op { verb, local: Sge { addr: addr + at, length: n as u32, lkey } });
            at += n;
        }
    }
}

/// A posted task's state, shared with the completion dispatcher.
struct TaskState {
    /// Requests of the task.
    requests: u32,
    /// Where it was posted (its room is given back as chains end).
    link: Weak<QpLink>,
    /// Chains whose last request has not completed.
    left: AtomicU32,
    /// The first request that failed, and its status.
    failed: Mutex<Option<(u32, i32)>>,
    done: Mutex<bool>,
    cv: Condvar,
}

impl TaskState {
    fn finish_chain(&self) -> bool {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            *self.done.lock() = true;
            self.cv.notify_all();
            return true;
        }
        false
    }
}

/// How a posted task ended: the index of the first request that failed
/// and its completion status, if one did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ended {
    pub failed: Option<(u32, i32)>,
    /// False if it did not end within the time given (its queue pair was
    /// then failed, and the requests flushed).
    pub complete: bool,
}

/// A posted task: [`Pending::wait`] ends it.
pub(crate) struct Pending {
    task: Arc<TaskState>,
    token: u32,
    hub: Arc<Hub>,
    link: Arc<QpLink>,
}

impl Pending {
    /// Chains `count` never posted (from request `at`, for `why`): they
    /// end now.
    fn abandon(&mut self, at: u32, why: i32, count: usize) {
        self.task.failed.lock().get_or_insert((at, why));
        for _ in 0..count {
            self.task.finish_chain();
        }
    }

    /// Whether it has ended.
    pub fn is_done(&self) -> bool {
        *self.task.done.lock()
    }

    /// Sleeps until it is done, or `deadline`.
    pub fn sleep_until_done(&self, deadline: Instant) {
        let mut done = self.task.done.lock();
        while !*done && !self.task.cv.wait_until(&mut done, deadline).timed_out() {}
    }

    /// Waits until every request it posted has completed: spinning for the
    /// hub's `spin` (polling the queue itself), then asleep. A task not
    /// done by `deadline` fails its queue pair (moving it to ERR, so every
    /// request completes, flushed) and waits for that.
    pub fn wait(self, deadline: Instant) -> Ended {
        let spin_until = Instant::now() + self.hub.spin;
        let mut complete = true;
        loop {
            if self.is_done() {
                break;
            }
            if Instant::now() < spin_until {
                self.hub.poll_once();
                std::hint::spin_loop();
                continue;
            }
            let mut done = self.task.done.lock();
            if *done {
                break;
            }
            let timed_out = self.task.cv.wait_until(&mut done, deadline).timed_out();
            if timed_out && !*done {
                drop(done);
                complete = false;
                self.link.fail("no completion within the peer timeout");
                // Flushes come within the NIC's own bound; a chain whose
                // signaled request was never posted is counted here.
                let mut done = self.task.done.lock();
                let drain = Instant::now() + Duration::from_secs(5);
                while !*done && !self.task.cv.wait_until(&mut done, drain).timed_out() {}
                break;
            }
        }
        let failed = *self.task.failed.lock();
        Ended { failed, complete: complete && self.is_done() }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.hub.tasks.lock().live.remove(&self.token);
    }
}

/// The tasks posted on a NIC, by token.
struct Tasks {
    next: u32,
    live: HashMap<u32, Arc<TaskState>>,
}

impl Tasks {
    fn insert(&mut self, t: Arc<TaskState>) -> u32 {
        loop {
            let token = self.next;
            self.next = self.next.wrapping_add(1).max(1);
            if let std::collections::hash_map::Entry::Vacant(v) = self.live.entry(token) {
                v.insert(t);
                return token;
            }
        }
    }
}

/// A NIC's completion queue and who waits on it, and its device's async
/// events.
struct Hub {
    dev: Arc<Device>,
    /// The port connections use, and whether it is down.
    port: u8,
    port_down: AtomicBool,
    cq: Arc<Cq>,
    /// Held while polling: completions are dispatched by one thread at a
    /// time.
    polling: Mutex<()>,
    tasks: Mutex<Tasks>,
    /// Queue pairs by number, to fail one whose request failed.
    links: Mutex<HashMap<u32, Weak<QpLink>>>,
    stop: AtomicBool,
    wake: OwnedFd,
    spin: Duration,
}

impl Hub {
    /// Polls once if no one else is: how many completions it dispatched.
    fn poll_once(&self) -> usize {
        let Some(_g) = self.polling.try_lock() else { return 0 };
        let mut buf = [Completion::default(); 32];
        let n = self.cq.poll(&mut buf).unwrap_or(0);
        for c in &buf[..n] {
            self.dispatch(c);
        }
        n
    }

    fn dispatch(&self, c: &Completion) {
        let token = (c.id >> 32) as u32;
        let index = c.id as u32;
        if c.status != status::SUCCESS {
            let link = self.links.lock().get(&c.qpn).and_then(Weak::upgrade);
            if let Some(l) = link {
                l.fail(&format!("a request completed with status {}", c.status));
            }
        }
        let task = self.tasks.lock().live.get(&token).cloned();
        let Some(task) = task else { return };
        if c.status != status::SUCCESS {
            let mut f = task.failed.lock();
            let flush = |s: i32| s == status::WR_FLUSH_ERR;
            // The error that caused the flushes, else the first request.
            let replace = match *f {
                None => true,
                Some((at, s)) => (flush(s) && !flush(c.status)) || (flush(s) == flush(c.status) && index < at),
            };
            if replace {
                *f = Some((index, c.status));
            }
        }
        // The last request of each chain completes exactly once (signaled
        // on success; in error or flushed otherwise), and ends its chain.
        let chain_end = (index as usize + 1) % CHAIN == 0 || index + 1 == task.requests;
        if chain_end {
            if let Some(l) = task.link.upgrade() {
                l.give_room(index % CHAIN as u32 + 1);
            }
            task.finish_chain();
        }
    }

    /// Takes the device's async event: a port down takes the NIC out of
    /// service until it is active again; a queue pair in error is failed
    /// (its outstanding requests complete, flushed).
    fn on_async_event(&self) {
        use super::objects::AsyncEvent;
        match self.dev.async_event() {
            Ok(AsyncEvent::PortDown(p)) if p == self.port => {
                log::warn!(target: crate::logs::RDMA, "{} port {p} is down: it takes no new task", self.dev.name);
                self.port_down.store(true, Ordering::Release)
            }
            Ok(AsyncEvent::PortActive(p)) if p == self.port => {
                log::info!(target: crate::logs::RDMA, "{} port {p} is active again", self.dev.name);
                self.port_down.store(false, Ordering::Release)
            }
            Ok(AsyncEvent::QpFatal(qpn) | AsyncEvent::QpError(qpn)) => {
                let link = self.links.lock().get(&qpn).and_then(Weak::upgrade);
                if let Some(l) = link {
                    l.fail("the NIC reported it in error");
                }
            }
            _ => {}
        }
    }

    /// The poller: drains the queue, spinning for `spin` after a
    /// completion, then asleep on the completion channel (or the wake
    /// descriptor, at drop), and takes the device's async events.
    fn run(self: Arc<Self>) {
        let mut last = Instant::now();
        while !self.stop.load(Ordering::Acquire) {
            if self.poll_once() > 0 {
                last = Instant::now();
                continue;
            }
            if last.elapsed() < self.spin {
                std::hint::spin_loop();
                continue;
            }
            if self.cq.arm().is_err() {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            // A completion between the last poll and the arm raised no
            // event: poll once more before sleeping.
            if self.poll_once() > 0 {
                last = Instant::now();
                continue;
            }
            let mut fds = [
                libc::pollfd { fd: self.cq.event_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.dev.async_fd(), events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: three pollfds of live descriptors.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), 3, 1000) };
            if r > 0 && fds[0].revents & libc::POLLIN != 0 {
                let _ = self.cq.wait();
            }
            if r > 0 && fds[2].revents & libc::POLLIN != 0 {
                self.on_async_event();
            }
            last = Instant::now();
        }
    }
}
