//! The rdma route: one-sided RDMA WRITE and READ between this engine's
//! registered memory and a peer's, over reliable-connected queue pairs of
//! both engines' NICs (feature `rdma`; `verbs::rails` has the NICs, their
//! completion queues and how a task is posted and ended).
//!
//! When a peer is opened, each NIC of this engine gets `rdma_qps_per_nic`
//! queue pairs to the peer's NIC of the same index (modulo how many it
//! has: rails pair up), connected over the peer's authenticated control
//! connection: this engine sends a card per queue pair (GID, number,
//! first packet sequence number, MTU), the peer makes its own and answers
//! with theirs. The peer keeps its queue pairs with that connection, and
//! the peer state here keeps these; closing the peer closes both.
//!
//! A transfer's remote ranges are named by address with the rkey the
//! peer's descriptor gives for the registration on that NIC (only an
//! authenticated peer's Describe carries rkeys); the peer lends the
//! ranges (a borrow) while transfers may touch them, so a deregistration
//! there fences at once and the region goes only after the last borrower
//! returned them. The local ranges are this engine's regions on the same
//! NIC. A task runs on one queue pair of one NIC: the NICs closest to the
//! local memory take a transfer's tasks in turn (striping), skipping a
//! NIC that failed and queue pairs that broke.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::Unreachable;
use super::{Copier, LocalSide, Mover, NoDeviceCopy, PeerOpening, PeerReach, PeerState, Posted, Reach, RouteImpl};
use crate::registry::Registration;
use crate::segment::ExportedRegistration;
use crate::transport::Span;
use crate::types::{Desc, Op, Route, TaskEnd};
use crate::verbs::rails::{Card, Ended, Pending, QpLink, Rail, Remote};
use crate::wire::{self, Kind, QpCard};

/// The rdma route.
pub(crate) struct Rdma;

/// One NIC's queue pairs to a peer, and the peer's NIC they reach.
pub(crate) struct PeerRail {
    rail: Arc<Rail>,
    peer_nic: u8,
    qps: Vec<Arc<QpLink>>,
}

/// What this engine holds for a peer over RDMA: the connected queue pairs
/// per NIC, or why there are none.
pub(crate) struct RdmaPeer {
    rails: Result<Arc<[PeerRail]>, String>,
    /// A round trip on the peer's control connection, after requests went
    /// unanswered: a peer that is gone is lost.
    probe: Arc<dyn Fn() + Send + Sync>,
    /// How long a task may wait for its completions (`peer_timeout_ms`).
    timeout: Duration,
}

impl PeerState for RdmaPeer {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl RdmaPeer {
    fn connect(peer: &PeerOpening<'_>) -> Result<Vec<PeerRail>, String> {
        let nics = peer.descriptor.rdma_nics;
        if nics == 0 {
            return Err("the peer has no RDMA NIC".into());
        }
        let mut rails = Vec::new();
        let mut cards = Vec::new();
        for rail in peer.rails.rails().iter().filter(|r| r.usable()) {
            let peer_nic = rail.index % nics;
            let mut qps = Vec::new();
            for _ in 0..peer.qps_per_nic {
                let link = rail.queue_pair(Remote::None).map_err(|e| e.to_string())?;
                cards.push(wire_card(&rail.card(&link), rail.index, peer_nic));
                qps.push(link);
            }
            rails.push(PeerRail { rail: rail.clone(), peer_nic, qps });
        }
        if rails.is_empty() {
            return Err(peer.rails.why().unwrap_or("no usable RDMA NIC").to_owned());
        }
        let mut body = Vec::new();
        wire::encode_rdma_connect(&mut body, peer.descriptor.epoch, &cards);
        let reply = (peer.control)(Kind::RdmaConnect, body).map_err(|e| format!("connecting queue pairs: {e}"))?;
        let theirs = wire::decode_rdma_accept(&reply).map_err(|e| format!("the peer's queue pairs: {e}"))?;
        wire::expect_count(Kind::RdmaAccept, cards.len(), theirs.len()).map_err(|e| e.to_string())?;
        let mut theirs = theirs.into_iter().zip(&cards);
        for r in &rails {
            for link in &r.qps {
                let (t, mine) = theirs.next().ok_or("the peer answered too few queue pairs")?;
                // The peer's card answers ours: its NIC is the one asked.
                if t.nic != mine.peer_nic || t.peer_nic != mine.nic {
                    return Err("the peer's queue pairs answer other NICs".into());
                }
                link.connect(&r.rail, &card(&t)).map_err(|e| format!("{}: {e}", r.rail.name))?;
            }
        }
        Ok(rails)
    }
}

/// A queue pair's card as the wire carries it: from this engine's NIC
/// `nic` to the peer's `peer_nic`.
fn wire_card(c: &Card, nic: u8, peer_nic: u8) -> QpCard {
    QpCard { gid: c.gid.octets(), qpn: c.qpn, psn: c.psn, mtu: c.mtu, nic, peer_nic }
}

/// The peer's queue pair a wire card describes.
fn card(c: &QpCard) -> Card {
    Card { gid: c.gid.into(), qpn: c.qpn, psn: c.psn, mtu: c.mtu }
}

/// The queue pairs this engine makes for an initiator that asked with
/// `cards`: one per card, on the NIC it names, connected to the card's
/// queue pair and allowing remote READ and WRITE (regions still say what
/// each range allows). Held by the initiator's connection and closed with
/// it.
pub(crate) fn accept(
    rails: &crate::verbs::rails::Rails,
    cards: &[QpCard],
) -> Result<(Vec<QpCard>, Vec<Arc<QpLink>>), String> {
    let mut mine = Vec::with_capacity(cards.len());
    let mut links = Vec::with_capacity(cards.len());
    for c in cards {
        let rail = rails
            .rails()
            .get(c.peer_nic as usize)
            .ok_or_else(|| format!("this engine has no RDMA NIC {}", c.peer_nic))?;
        let link = rail.queue_pair(Remote::ReadWrite).map_err(|e| e.to_string())?;
        link.connect(rail, &card(c)).map_err(|e| format!("{}: {e}", rail.name))?;
        mine.push(wire_card(&rail.card(&link), rail.index, c.nic));
        links.push(link);
    }
    Ok((mine, links))
}

impl RouteImpl for Rdma {
    fn route(&self) -> Route {
        Route::Rdma
    }

    /// Queue pairs to the peer on each NIC, connected over its control
    /// connection; or why not (kept: prepare says it).
    fn open_peer(&self, peer: &PeerOpening<'_>) -> Option<Box<dyn PeerState>> {
        let rails = match peer.rails.rails().is_empty() {
            true => Err(peer.rails.why().unwrap_or("no RDMA NIC").to_owned()),
            false => RdmaPeer::connect(peer).map(Arc::from),
        };
        Some(Box::new(RdmaPeer { rails, timeout: peer.timeout, probe: peer.probe.clone() }))
    }

    fn plan(&self, target: &Reach<'_>, remote: &[Desc]) -> Result<Mover, Unreachable> {
        let Reach::Peer(p) = target else { return Err(Unreachable::NotPeer) };
        let state = p.state::<RdmaPeer>(Route::Rdma).ok_or_else(|| Unreachable::Rdma("no RDMA NIC".into()))?;
        let rails = state.rails.as_ref().map_err(|why| Unreachable::Rdma(why.clone()))?;
        if let Some(down) = rails.iter().find(|r| !r.rail.usable()).filter(|_| rails.iter().all(|r| !r.rail.usable())) {
            return Err(Unreachable::Rdma(format!("the port of NIC {} is down", down.rail.name)));
        }
        if rails.iter().all(|r| r.qps.iter().all(|q| q.broken())) {
            return Err(Unreachable::Rdma("every queue pair to the peer failed (open it again)".into()));
        }
        // The rkey of every registration named, on each peer NIC reached.
        let mut raws: Vec<u64> = remote.iter().map(|d| d.registration.to_raw()).collect();
        raws.sort_unstable();
        raws.dedup();
        let mut keys: Vec<(u64, Vec<Option<u32>>)> = Vec::with_capacity(raws.len());
        for raw in raws {
            let r = p.segment.get(raw).ok_or(Unreachable::UnknownRegistration)?;
            if let Some(rail) = rails.iter().find(|pr| r.rkeys.get(pr.peer_nic as usize).copied().flatten().is_none()) {
                return Err(Unreachable::Rdma(match r.device {
                    Some(device) => format!(
                        "a target range is CUDA device memory (device {device}) with no region on the peer's NIC {}",
                        rail.peer_nic
                    ),
                    None => format!("a target range has no region on the peer's NIC {}", rail.peer_nic),
                }));
            }
            keys.push((raw, r.rkeys.clone()));
        }
        Ok(Mover::Copy(Box::new(RdmaCopy {
            rails: rails.clone(),
            keys,
            local: Vec::new(),
            use_rails: (0..rails.len()).collect(),
            device: None,
            gpudirect: None,
            staging: None,
            next: AtomicUsize::new(0),
            timeout: state.timeout,
            probe: state.probe.clone(),
        })))
    }

    fn auto_reason(&self) -> Option<&'static str> {
        Some("both engines have RDMA NICs, connected")
    }

    fn address(&self, _target: &PeerReach<'_>, r: &ExportedRegistration) -> Result<(u64, u64), Unreachable> {
        // Addresses in the peer's process (or its device, for a dma-buf
        // region), with the registration the rkey is looked up by.
        Ok((r.addr, r.id.to_raw()))
    }

    fn borrows(&self) -> bool {
        true
    }

    fn borrow_flags(&self) -> u8 {
        wire::BORROW_RDMA
    }
}

/// RDMA reads and writes of one transfer.
pub(crate) struct RdmaCopy {
    rails: Arc<[PeerRail]>,
    /// Rkeys per peer NIC, by remote registration (sorted).
    keys: Vec<(u64, Vec<Option<u32>>)>,
    /// The local registrations named, by address.
    local: Vec<Arc<Registration>>,
    /// The NICs (indexes into `rails`) its tasks take in turn.
    use_rails: Vec<usize>,
    device: Option<u32>,
    /// How the NICs reach the local device memory (GPUDirect), if they do.
    gpudirect: Option<&'static str>,
    /// The pool device memory is staged through when they do not.
    staging: Option<Arc<super::staging::StagingPool>>,
    next: AtomicUsize,
    timeout: Duration,
    probe: Arc<dyn Fn() + Send + Sync>,
}

impl RdmaCopy {
    /// The lkey of the local range `[addr, addr + len)` on NIC `rail`.
    fn lkey(&self, rail: u8, addr: u64, len: u64) -> Option<u32> {
        let i = self.local.partition_point(|r| r.base as u64 <= addr);
        let found = self.local[..i]
            .iter()
            .rev()
            .find(|r| addr + len <= r.base as u64 + r.len)
            .and_then(|r| r.rdma.lkey(rail).ok());
        // A staged task's local side is a staging buffer.
        found.or_else(|| self.staging.as_ref()?.lkey(rail, addr, len))
    }

    fn rkey(&self, peer_nic: u8, raw: u64) -> Option<u32> {
        let i = self.keys.binary_search_by_key(&raw, |(r, _)| *r).ok()?;
        self.keys[i].1.get(peer_nic as usize).copied().flatten()
    }

    /// The queue pair the next task takes: the next NIC in turn that
    /// works, and its next queue pair that works.
    fn pick(&self) -> Option<(&PeerRail, &Arc<QpLink>)> {
        let n = self.use_rails.len();
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        for i in 0..n {
            let pr = &self.rails[self.use_rails[(turn + i) % n]];
            if !pr.rail.usable() {
                continue;
            }
            let q = pr.qps.len();
            if let Some(link) = (0..q).map(|j| &pr.qps[(turn / n + j) % q]).find(|l| !l.broken()) {
                return Some((pr, link));
            }
        }
        None
    }
}

impl Copier for RdmaCopy {
    fn name(&self) -> &'static str {
        "RDMA reads and writes"
    }

    fn copy(&self, op: Op, spans: &[Span], limit: u64) -> (u64, Option<TaskEnd>) {
        super::device::post_and_finish(self, op, spans, limit)
    }

    fn post(&self, op: Op, spans: &[Span], limit: u64) -> Option<Result<Box<dyn Posted>, (u64, Option<TaskEnd>)>> {
        let refused = Some(Err((0, Some(TaskEnd::Failed { effect_unknown: false }))));
        let Some((pr, link)) = self.pick() else { return refused };
        let mut ops = Vec::with_capacity(spans.len());
        let mut lens = Vec::with_capacity(spans.len());
        for (s, len) in super::within(spans, limit) {
            let (Some(lkey), Some(rkey)) =
                (self.lkey(pr.rail.index, s.local, len), self.rkey(pr.peer_nic, s.remote_reg))
            else {
                return refused;
            };
            let before = ops.len();
            crate::verbs::rails::Op::split(op == Op::Read, s.local, lkey, s.remote, rkey, len, &mut ops);
            lens.extend(ops[before..].iter().map(|o| u64::from(o.local.length)));
        }
        let deadline = crate::time::deadline_after(self.timeout);
        let pending = link.post(&ops, deadline);
        Some(Ok(Box::new(RdmaPosted { pending, lens, op, deadline, probe: self.probe.clone() })))
    }

    /// Device memory on the local side is read and written by the NIC
    /// where it has a region there (GPUDirect through dma-buf); the NICs
    /// every local range has a region on, closest to the memory first,
    /// take the tasks.
    fn with_local(mut self: Box<Self>, local: &LocalSide<'_>) -> Result<Box<dyn Copier>, NoDeviceCopy> {
        let mut loans: Vec<Arc<Registration>> = local.loans.to_vec();
        loans.sort_unstable_by_key(|r| r.base as u64);
        let on = |i: usize, r: &Registration| r.rdma.lkey(self.rails[i].rail.index).is_ok();
        let direct: Vec<usize> = (0..self.rails.len()).filter(|&i| loans.iter().all(|r| on(i, r))).collect();
        if let (Some(device), true) = (local.device, direct.is_empty()) {
            // No GPUDirect: the device memory goes through the pool, whose
            // buffers are regions on every NIC; its host ranges still need
            // theirs.
            let why = loans.iter().find(|r| !r.is_host() && !r.rdma.any()).and_then(|r| r.rdma.why_not(0));
            let hosts: Vec<usize> =
                (0..self.rails.len()).filter(|&i| loans.iter().filter(|r| r.is_host()).all(|r| on(i, r))).collect();
            if hosts.is_empty() {
                return Err(NoDeviceCopy { device, kind: self.name() });
            }
            self.use_rails = hosts;
            self.staging = Some(local.pool.clone());
            self.local = loans;
            let why = why.unwrap_or_else(|| "no NIC has a region of it".into());
            return Ok(super::staging::Staged::over(self, local, Some(why)));
        }
        self.gpudirect = loans.iter().find_map(|r| r.rdma.gpudirect()).map(|g| g.name());
        let mut usable = direct;
        // The NICs closest to the local memory (its GPU's PCI place, or
        // the NUMA node of its first page) take the tasks, in turn.
        let near = match local.device {
            Some(d) => Some(crate::verbs::Near::Gpu(d)),
            None => loans.first().and_then(|r| crate::verbs::numa_node_of(r.base as u64)).map(crate::verbs::Near::Numa),
        };
        if let Some(near) = near {
            let place = crate::verbs::Place::of(near);
            let best = usable.iter().map(|&i| self.rails[i].rail.distance(&place)).min();
            usable.retain(|&i| Some(self.rails[i].rail.distance(&place)) == best);
        }
        if usable.is_empty() {
            if let Some(device) = local.device {
                return Err(NoDeviceCopy { device, kind: self.name() });
            }
        } else {
            self.use_rails = usable;
        }
        self.device = local.device;
        self.local = loans;
        Ok(self)
    }

    fn waits(&self) -> bool {
        true
    }

    fn device_note(&self) -> Option<String> {
        self.device.map(|d| {
            let via = self.gpudirect.unwrap_or("dma-buf");
            format!("CUDA device memory (device {d}) read and written by the NIC through {via} (GPUDirect RDMA)")
        })
    }
}

/// A posted task.
struct RdmaPosted {
    pending: Pending,
    /// Bytes of each request, in order.
    lens: Vec<u64>,
    op: Op,
    deadline: std::time::Instant,
    probe: Arc<dyn Fn() + Send + Sync>,
}

impl Posted for RdmaPosted {
    fn await_done(&self) {
        self.pending.sleep_until_done(self.deadline);
    }

    fn finish(self: Box<Self>) -> (u64, Option<TaskEnd>) {
        let total: u64 = self.lens.iter().sum();
        let Ended { failed, complete } = self.pending.wait(self.deadline);
        // Requests the peer never answered (its NIC, its link or the peer
        // itself gone): ask on its control connection, so a dead peer is
        // lost (its other work then fails at once) and a live one is not.
        if !complete || failed.is_some_and(|(_, s)| s == crate::verbs::rails::RETRY_EXCEEDED) {
            (self.probe)();
        }
        match failed {
            None if complete => (total, None),
            // Not all of it completed even after its queue pair went to
            // ERR: nothing is known of it.
            None => (0, Some(TaskEnd::Failed { effect_unknown: self.op == Op::Write })),
            // Requests complete in order: every one before the failed one
            // moved its bytes. A READ landed exactly that prefix; a WRITE
            // may have moved more of the failed one.
            Some((at, _)) => {
                let done = self.lens[..(at as usize).min(self.lens.len())].iter().sum();
                (done, Some(TaskEnd::Failed { effect_unknown: self.op == Op::Write }))
            }
        }
    }
}
