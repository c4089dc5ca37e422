//! The verbs objects the RDMA route makes, as owners that free them on
//! drop in the order the library requires: a queue pair holds its
//! protection domain and completion queue, a region its protection
//! domain, each of them the device. The types passed are `sys`'s.
//!
//! Data-path calls (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`,
//! `ibv_req_notify_cq`) are inline functions in `verbs.h` that call
//! through the context's ops table; so are they here.

// The RDMA route posts WRITE and READ only; SEND/RECV, WRITE with
// immediate and a few statuses are here for the tests that hold the shim
// to what a NIC does.
#![cfg_attr(not(test), allow(dead_code, reason = "verbs the route does not post yet, tested here"))]

use std::ffi::{c_int, c_void};
use std::net::Ipv6Addr;
use std::sync::Arc;

use super::VerbsError;
use super::loader::{Context, Library, failed};
pub(crate) use super::sys::Sge;
use super::sys::*;

/// Slots of `struct ibv_context_ops` (at offset 8 of `struct ibv_context`).
const OP_POLL_CQ: usize = 11;
const OP_REQ_NOTIFY_CQ: usize = 12;
const OP_POST_SEND: usize = 25;
const OP_POST_RECV: usize = 26;

type PollCq = unsafe extern "C" fn(*mut c_void, c_int, *mut IbvWc) -> c_int;
type ReqNotifyCq = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;
type PostSend = unsafe extern "C" fn(*mut IbvQp, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int;
type PostRecv = unsafe extern "C" fn(*mut IbvQp, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;

/// The ops-table entry `slot` of the context `ctx` (as `verbs.h`'s inline
/// helpers read it).
///
/// # Safety
/// `ctx` is a live `struct ibv_context`, and `T` the slot's function
/// pointer type.
unsafe fn op<T: Copy>(ctx: *mut c_void, slot: usize) -> Option<T> {
    // SAFETY: per the contract; an unset slot is a null pointer, which is
    // `None` of an `Option` of a function pointer.
    unsafe { *((ctx as *const u8).add(8 + 8 * slot) as *const Option<T>) }
}

/// What a region lets peers do.
pub(crate) mod access {
    pub const LOCAL_WRITE: u32 = 1;
    pub const REMOTE_WRITE: u32 = 2;
    pub const REMOTE_READ: u32 = 4;
}

/// An opened NIC.
pub(crate) struct Device {
    lib: &'static Library,
    ctx: *mut Context,
    pub name: String,
}

// SAFETY: verbs objects may be used from any thread (rdma-core's
// contract); the owner only frees it, once.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl Device {
    /// Opens the NIC called `name` of `lib`.
    pub(super) fn open_in(lib: &'static Library, name: &str) -> Result<Arc<Device>, VerbsError> {
        let mut n: c_int = 0;
        // SAFETY: the library's call, with an int to fill.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(failed("ibv_get_device_list", errno()));
        }
        let (mut ctx, mut found) = (std::ptr::null_mut(), false);
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: the list has n entries.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a device of the live list; its name is NUL-terminated.
            let this = unsafe { (lib.get_device_name)(dev) };
            // SAFETY: as above.
            if !this.is_null() && unsafe { std::ffi::CStr::from_ptr(this) }.to_bytes() == name.as_bytes() {
                found = true;
                // SAFETY: as above.
                ctx = unsafe { (lib.open_device)(dev) };
                break;
            }
        }
        let e = errno();
        // SAFETY: the list the library gave, freed once (an open context
        // outlives it).
        unsafe { (lib.free_device_list)(list) };
        if ctx.is_null() {
            let why = if found { std::io::Error::from_raw_os_error(e).to_string() } else { "no such NIC".to_owned() };
            return Err(VerbsError::Call { call: "ibv_open_device", reason: format!("{name}: {why}") });
        }
        Ok(Arc::new(Device { lib, ctx, name: name.to_owned() }))
    }

    /// A protection domain.
    pub fn alloc_pd(self: &Arc<Self>) -> Result<Arc<Pd>, VerbsError> {
        // SAFETY: a live context.
        let pd = unsafe { (self.lib.alloc_pd)(self.ctx) };
        if pd.is_null() {
            return Err(failed("ibv_alloc_pd", errno()));
        }
        Ok(Arc::new(Pd { dev: self.clone(), pd }))
    }

    /// A completion queue of `entries`, with its own completion channel.
    pub fn create_cq(self: &Arc<Self>, entries: u32) -> Result<Arc<Cq>, VerbsError> {
        // SAFETY: a live context.
        let channel = unsafe { (self.lib.create_comp_channel)(self.ctx) };
        if channel.is_null() {
            return Err(failed("ibv_create_comp_channel", errno()));
        }
        let entries = c_int::try_from(entries).unwrap_or(c_int::MAX);
        // SAFETY: a live context and channel.
        let cq = unsafe { (self.lib.create_cq)(self.ctx, entries, std::ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let e = errno();
            // SAFETY: the channel made above, with no CQ.
            unsafe { (self.lib.destroy_comp_channel)(channel) };
            return Err(failed("ibv_create_cq", e));
        }
        Ok(Arc::new(Cq { dev: self.clone(), cq, channel }))
    }
}

/// An async event of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AsyncEvent {
    /// A queue pair (its number) went to ERR by itself.
    QpFatal(u32),
    /// A queue pair (its number) saw a request or access error.
    QpError(u32),
    /// A port went down.
    PortDown(u8),
    /// A port came back.
    PortActive(u8),
    /// A completion queue overran (or another CQ error).
    CqError,
    /// Another `ibv_event_type`.
    Other(i32),
}

impl Device {
    /// Waits for the device's next async event (its descriptor,
    /// [`Device::async_fd`], is readable when one is there).
    pub fn async_event(&self) -> Result<AsyncEvent, VerbsError> {
        let mut e = IbvAsyncEvent { element: 0, event_type: 0, _pad: 0 };
        // SAFETY: a live context and an event to fill.
        if unsafe { (self.lib.get_async_event)(self.ctx, &mut e) } != 0 {
            return Err(failed("ibv_get_async_event", errno()));
        }
        // SAFETY: for a QP event the element is the queue pair, live until
        // the event is acknowledged below.
        let qpn = || unsafe { (*(e.element as *const IbvQp)).qp_num };
        let event = match e.event_type {
            1 => AsyncEvent::QpFatal(qpn()),
            2 | 3 => AsyncEvent::QpError(qpn()),
            10 => AsyncEvent::PortDown(e.element as u8),
            9 => AsyncEvent::PortActive(e.element as u8),
            0 => AsyncEvent::CqError,
            other => AsyncEvent::Other(other),
        };
        // SAFETY: the event taken above, acknowledged once.
        unsafe { (self.lib.ack_async_event)(&mut e) };
        Ok(event)
    }

    /// The descriptor that is readable when an async event is there.
    pub fn async_fd(&self) -> c_int {
        // SAFETY: a live `struct ibv_context`: `async_fd` at offset 268.
        unsafe { *((self.ctx as *const u8).add(268) as *const c_int) }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: the context this owner opened; every object made in it
        // holds the device, so none is left.
        unsafe { (self.lib.close_device)(self.ctx) };
    }
}

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// A protection domain.
pub(crate) struct Pd {
    dev: Arc<Device>,
    pd: *mut c_void,
}

// SAFETY: as for Device.
unsafe impl Send for Pd {}
// SAFETY: as for Device.
unsafe impl Sync for Pd {}

impl Pd {
    /// Registers `[addr, addr + len)` with `access` ([`access`] flags).
    ///
    /// # Safety
    /// The range is memory of this process that stays valid, and that the
    /// NIC (and, with remote access, peers holding the rkey) may read or
    /// write, until the region is dropped.
    pub unsafe fn register(self: &Arc<Self>, addr: u64, len: u64, access: u32) -> Result<Mr, VerbsError> {
        let len = usize::try_from(len).map_err(|_| failed("ibv_reg_mr", libc::EINVAL))?;
        // SAFETY: a live protection domain; the range per the contract.
        let mr = unsafe { (self.dev.lib.reg_mr)(self.pd, addr as *mut c_void, len, access as c_int) };
        if mr.is_null() {
            return Err(failed("ibv_reg_mr", errno()));
        }
        // SAFETY: the region the library made.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(Mr { pd: self.clone(), mr, lkey, rkey })
    }

    /// Registers `[offset, offset + len)` of the dma-buf `fd` (device
    /// memory exported by the CUDA driver), named by requests from `iova`
    /// (GPUDirect RDMA without peermem).
    ///
    /// # Safety
    /// The memory behind the dma-buf stays allocated until the region is
    /// dropped (the NIC, and peers holding the rkey, may reach it).
    pub unsafe fn register_dmabuf(
        self: &Arc<Self>,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
        access: u32,
    ) -> Result<Mr, VerbsError> {
        let reg = self.dev.lib.reg_dmabuf_mr.ok_or_else(|| failed("ibv_reg_dmabuf_mr", libc::EOPNOTSUPP))?;
        let len = usize::try_from(len).map_err(|_| failed("ibv_reg_dmabuf_mr", libc::EINVAL))?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&fd);
        // SAFETY: a live protection domain and descriptor; the memory per
        // the contract.
        let mr = unsafe { reg(self.pd, offset, len, iova, fd, access as c_int) };
        if mr.is_null() {
            return Err(failed("ibv_reg_dmabuf_mr", errno()));
        }
        // SAFETY: the region the library made.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(Mr { pd: self.clone(), mr, lkey, rkey })
    }

    /// Whether the NIC takes dma-buf regions: the probe rdma-core's users
    /// make, a registration of descriptor -1 that fails with EBADF when it
    /// does (and EOPNOTSUPP when it does not).
    pub fn dmabuf_supported(&self) -> bool {
        let Some(reg) = self.dev.lib.reg_dmabuf_mr else { return false };
        // SAFETY: a live protection domain; descriptor -1 maps nothing.
        let mr = unsafe { reg(self.pd, 0, 0, 0, -1, 0) };
        !mr.is_null() || errno() == libc::EBADF
    }

    /// An RC queue pair completing into `cq`, of `depth` requests each way.
    pub fn create_qp(self: &Arc<Self>, cq: &Arc<Cq>, depth: u32) -> Result<Qp, VerbsError> {
        let mut init = IbvQpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq.cq,
            recv_cq: cq.cq,
            srq: std::ptr::null_mut(),
            cap: IbvQpCap {
                max_send_wr: depth,
                max_recv_wr: depth,
                max_send_sge: 16,
                max_recv_sge: 16,
                max_inline_data: 0,
            },
            qp_type: 2, // RC
            sq_sig_all: 0,
            _pad: 0,
        };
        // SAFETY: a live protection domain and CQ.
        let qp = unsafe { (self.dev.lib.create_qp)(self.pd, &mut init) };
        if qp.is_null() {
            return Err(failed("ibv_create_qp", errno()));
        }
        // SAFETY: the queue pair the library made.
        let qpn = unsafe { (*qp).qp_num };
        Ok(Qp { pd: self.clone(), _cq: cq.clone(), qp, qpn })
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: this owner's domain; its regions and queue pairs hold it,
        // so none is left.
        unsafe { (self.dev.lib.dealloc_pd)(self.pd) };
    }
}

/// A memory region: its keys work until it is dropped.
pub(crate) struct Mr {
    pd: Arc<Pd>,
    mr: *mut IbvMr,
    pub lkey: u32,
    pub rkey: u32,
}

// SAFETY: as for Device.
unsafe impl Send for Mr {}
// SAFETY: as for Device.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: this owner's region; once deregistered no access through
        // its keys runs.
        unsafe { (self.pd.dev.lib.dereg_mr)(self.mr) };
    }
}

/// A completion queue and its channel.
pub(crate) struct Cq {
    dev: Arc<Device>,
    cq: *mut c_void,
    channel: *mut IbvCompChannel,
}

// SAFETY: as for Device.
unsafe impl Send for Cq {}
// SAFETY: as for Device.
unsafe impl Sync for Cq {}

/// One completion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Completion {
    /// The work request's id.
    pub id: u64,
    /// `ibv_wc_status` (0: success).
    pub status: i32,
    /// `ibv_wc_opcode`.
    pub opcode: i32,
    pub bytes: u32,
    /// The immediate (host order), if one came.
    pub imm: Option<u32>,
    pub qpn: u32,
}

/// Completion statuses the route tells apart.
pub(crate) mod status {
    pub const SUCCESS: i32 = 0;
    pub const LOC_PROT_ERR: i32 = 4;
    pub const WR_FLUSH_ERR: i32 = 5;
    pub const REM_ACCESS_ERR: i32 = 10;
    pub const RETRY_EXC_ERR: i32 = 12;
}

impl Cq {
    /// Takes up to `out.len()` completions (at most 32 a call) into `out`:
    /// how many. No allocation: the route polls on its hot path.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        let mut wc = [IbvWc::default(); 32];
        let want = out.len().min(wc.len());
        // SAFETY: a live CQ; its context's ops table.
        let poll = unsafe { op::<PollCq>(*(self.cq as *const *mut c_void), OP_POLL_CQ) };
        let poll = poll.ok_or_else(|| failed("ibv_poll_cq", libc::EOPNOTSUPP))?;
        // SAFETY: a live CQ and room for `want` entries.
        let n = unsafe { poll(self.cq, want as c_int, wc.as_mut_ptr()) };
        if n < 0 {
            return Err(VerbsError::Call { call: "ibv_poll_cq", reason: "the completion queue overran".into() });
        }
        let n = (n as usize).min(want);
        for (o, w) in out.iter_mut().zip(&wc[..n]) {
            *o = Completion {
                id: w.wr_id,
                status: w.status,
                opcode: w.opcode,
                bytes: w.byte_len,
                imm: (w.wc_flags & 2 != 0).then_some(u32::from_be(w.imm_data)),
                qpn: w.qp_num,
            };
        }
        Ok(n)
    }

    /// Asks for an event on the channel at the next completion.
    pub fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: a live CQ; its context's ops table.
        let notify = unsafe { op::<ReqNotifyCq>(*(self.cq as *const *mut c_void), OP_REQ_NOTIFY_CQ) };
        let notify = notify.ok_or_else(|| failed("ibv_req_notify_cq", libc::EOPNOTSUPP))?;
        // SAFETY: a live CQ.
        match unsafe { notify(self.cq, 0) } {
            0 => Ok(()),
            e => Err(failed("ibv_req_notify_cq", e)),
        }
    }

    /// Waits for the event [`Cq::arm`] asked for, and acknowledges it.
    pub fn wait(&self) -> Result<(), VerbsError> {
        let (mut cq, mut ctx) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a live channel and two out-pointers.
        if unsafe { (self.dev.lib.get_cq_event)(self.channel, &mut cq, &mut ctx) } != 0 {
            return Err(failed("ibv_get_cq_event", errno()));
        }
        // SAFETY: the CQ the event was for (this one: its channel is its
        // own).
        unsafe { (self.dev.lib.ack_cq_events)(cq, 1) };
        Ok(())
    }

    /// The channel's descriptor: readable when an event is there.
    pub fn event_fd(&self) -> c_int {
        // SAFETY: a live channel.
        unsafe { (*self.channel).fd }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: this owner's CQ (its queue pairs hold it, so none is
        // left), then its channel.
        unsafe {
            (self.dev.lib.destroy_cq)(self.cq);
            (self.dev.lib.destroy_comp_channel)(self.channel);
        }
    }
}

/// Where a queue pair's remote end is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RemoteQp {
    pub gid: Ipv6Addr,
    pub qpn: u32,
    /// The first packet sequence number it sends.
    pub psn: u32,
}

/// An RDMA operation of a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verb {
    Write { remote_addr: u64, rkey: u32 },
    WriteImm { remote_addr: u64, rkey: u32, imm: u32 },
    Read { remote_addr: u64, rkey: u32 },
    Send,
}

/// One work request: its id, verb, local range, and whether it completes
/// when it succeeds (an error always completes). One local entry each:
/// what the route posts, with nothing to allocate per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkRequest {
    pub id: u64,
    pub verb: Verb,
    pub local: Sge,
    pub signaled: bool,
}

/// An RC queue pair.
pub(crate) struct Qp {
    pd: Arc<Pd>,
    /// Held: it outlives the queue pair.
    _cq: Arc<Cq>,
    qp: *mut IbvQp,
    pub qpn: u32,
}

// SAFETY: as for Device.
unsafe impl Send for Qp {}
// SAFETY: as for Device.
unsafe impl Sync for Qp {}

/// `ibv_mtu` of an MTU in bytes (4096 for anything larger).
fn mtu_enum(bytes: u32) -> c_int {
    match bytes {
        0..=256 => 1,
        257..=512 => 2,
        513..=1024 => 3,
        1025..=2048 => 4,
        _ => 5,
    }
}

impl Qp {
    fn modify(&self, attr: &mut IbvQpAttr, mask: c_int, call: &'static str) -> Result<(), VerbsError> {
        // SAFETY: a live queue pair and attributes of the library's layout.
        match unsafe { (self.pd.dev.lib.modify_qp)(self.qp, attr, mask) } {
            0 => Ok(()),
            e => Err(failed(call, e)),
        }
    }

    /// RESET to INIT on `port`, allowing peers `access`.
    pub fn to_init(&self, port: u8, access: u32) -> Result<(), VerbsError> {
        let mut a = IbvQpAttr { qp_state: 1, port_num: port, qp_access_flags: access, ..Default::default() };
        // STATE | PKEY_INDEX | PORT | ACCESS_FLAGS
        self.modify(&mut a, 1 | 1 << 4 | 1 << 5 | 1 << 3, "ibv_modify_qp(INIT)")
    }

    /// INIT to RTR toward `remote`, from GID `sgid_index` of `port`, with
    /// the smaller of both ends' MTUs (`mtu`, bytes).
    pub fn to_rtr(&self, remote: RemoteQp, port: u8, sgid_index: u8, mtu: u32) -> Result<(), VerbsError> {
        let raw = remote.gid.octets();
        let words = [
            u64::from_ne_bytes(raw[..8].try_into().unwrap_or_default()),
            u64::from_ne_bytes(raw[8..].try_into().unwrap_or_default()),
        ];
        let ah =
            IbvAhAttr { dgid: words, sgid_index, hop_limit: 255, is_global: 1, port_num: port, ..Default::default() };
        let mut a = IbvQpAttr {
            qp_state: 2,
            path_mtu: mtu_enum(mtu),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn & 0xff_ffff,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            ah_attr: ah,
            ..Default::default()
        };
        // STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER
        self.modify(&mut a, 1 | 1 << 7 | 1 << 8 | 1 << 20 | 1 << 12 | 1 << 17 | 1 << 15, "ibv_modify_qp(RTR)")
    }

    /// RTR to RTS, sending from packet sequence number `psn`.
    pub fn to_rts(&self, psn: u32) -> Result<(), VerbsError> {
        let mut a = IbvQpAttr {
            qp_state: 3,
            sq_psn: psn & 0xff_ffff,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
            ..Default::default()
        };
        // STATE | SQ_PSN | TIMEOUT | RETRY_CNT | RNR_RETRY | MAX_QP_RD_ATOMIC
        self.modify(&mut a, 1 | 1 << 16 | 1 << 9 | 1 << 10 | 1 << 11 | 1 << 13, "ibv_modify_qp(RTS)")
    }

    /// To ERR: every outstanding request completes (flushed).
    pub fn to_error(&self) -> Result<(), VerbsError> {
        let mut a = IbvQpAttr { qp_state: 6, ..Default::default() };
        self.modify(&mut a, 1, "ibv_modify_qp(ERR)")
    }

    /// Posts `wrs` as one chain. `Err((i, why))`: request `i` and those
    /// after it were not posted.
    pub fn post(&self, wrs: &[WorkRequest]) -> Result<(), (usize, VerbsError)> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut chain: Vec<IbvSendWr> = wrs
            .iter()
            .map(|w| {
                let (opcode, remote_addr, rkey, imm) = match w.verb {
                    Verb::Write { remote_addr, rkey } => (0, remote_addr, rkey, 0),
                    Verb::WriteImm { remote_addr, rkey, imm } => (1, remote_addr, rkey, imm.to_be()),
                    Verb::Send => (2, 0, 0, 0),
                    Verb::Read { remote_addr, rkey } => (4, remote_addr, rkey, 0),
                };
                IbvSendWr {
                    wr_id: w.id,
                    next: std::ptr::null_mut(),
                    sg_list: &w.local,
                    num_sge: 1,
                    opcode,
                    send_flags: if w.signaled { 2 } else { 0 },
                    imm_data: imm,
                    remote_addr,
                    rkey,
                    _rest: [0; 7],
                    _tail: [0; 6],
                }
            })
            .collect();
        let base = chain.as_mut_ptr();
        for i in 1..chain.len() {
            // SAFETY: within the chain's allocation, which outlives the call.
            chain[i - 1].next = unsafe { base.add(i) };
        }
        // SAFETY: a live queue pair; its context's ops table.
        let post = unsafe { op::<PostSend>((*self.qp).context, OP_POST_SEND) };
        let post = post.ok_or_else(|| (0, failed("ibv_post_send", libc::EOPNOTSUPP)))?;
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live queue pair and a well-formed chain whose entries
        // and lists live until the call returns (the library copies them).
        match unsafe { post(self.qp, base, &mut bad) } {
            0 => Ok(()),
            e => {
                // SAFETY: `bad` points into the chain.
                let at = if bad.is_null() { 0 } else { unsafe { bad.offset_from(base) }.max(0) as usize };
                Err((at, failed("ibv_post_send", e)))
            }
        }
    }

    /// Posts one receive of `local` entries.
    pub fn post_recv(&self, id: u64, local: &[Sge]) -> Result<(), VerbsError> {
        let mut wr = IbvRecvWr {
            wr_id: id,
            next: std::ptr::null_mut(),
            sg_list: local.as_ptr(),
            num_sge: local.len() as c_int,
            _pad: 0,
        };
        // SAFETY: a live queue pair; its context's ops table.
        let post = unsafe { op::<PostRecv>((*self.qp).context, OP_POST_RECV) };
        let post = post.ok_or_else(|| failed("ibv_post_recv", libc::EOPNOTSUPP))?;
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live queue pair and one request.
        match unsafe { post(self.qp, &mut wr, &mut bad) } {
            0 => Ok(()),
            e => Err(failed("ibv_post_recv", e)),
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: this owner's queue pair; once destroyed nothing of it runs.
        unsafe { (self.pd.dev.lib.destroy_qp)(self.qp) };
    }
}

#[cfg(test)]
mod tests;
