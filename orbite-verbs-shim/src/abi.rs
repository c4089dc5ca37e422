//! The parts of rdma-core's `verbs.h` this shim fills, as `#[repr(C)]`
//! structs with the layouts of x86_64 Linux (checked by the size and
//! offset assertions below). Written from the header's documented
//! layout; only the fields the shim writes are named, the rest is
//! padding kept at its size.

use std::ffi::c_void;

/// `struct ibv_device`: the class device, as `ibv_get_device_list` hands
/// it out.
#[repr(C)]
pub struct IbvDevice {
    /// `_ops`: obsolete, never used.
    pub ops: [usize; 2],
    /// `node_type` (1: a channel adapter).
    pub node_type: i32,
    /// `transport_type` (0: InfiniBand transport, which RoCE is too).
    pub transport_type: i32,
    pub name: [u8; 64],
    pub dev_name: [u8; 64],
    pub dev_path: [u8; 256],
    pub ibdev_path: [u8; 256],
}

/// `struct ibv_context_ops`: 32 function pointers, of which the inline
/// data-path helpers of `verbs.h` call four (`poll_cq` at slot 11,
/// `req_notify_cq` at 12, `post_send` at 25, `post_recv` at 26).
#[repr(C)]
pub struct IbvContextOps {
    pub slots: [Option<unsafe extern "C" fn()>; 32],
}

/// `struct ibv_context`.
#[repr(C)]
pub struct IbvContext {
    pub device: *mut IbvDevice,
    pub ops: IbvContextOps,
    pub cmd_fd: i32,
    pub async_fd: i32,
    pub num_comp_vectors: i32,
    pub _pad: i32,
    /// `pthread_mutex_t`.
    pub mutex: libc::pthread_mutex_t,
    /// Not `UINTPTR_MAX`: no extended `verbs_context` in front of it, so
    /// every inline helper falls back to an exported call.
    pub abi_compat: *mut c_void,
}

/// `struct ibv_device_attr`.
#[repr(C)]
pub struct IbvDeviceAttr {
    pub fw_ver: [u8; 64],
    /// Big endian.
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: i32,
    pub max_qp_wr: i32,
    pub device_cap_flags: u32,
    pub max_sge: i32,
    pub max_sge_rd: i32,
    pub max_cq: i32,
    pub max_cqe: i32,
    pub max_mr: i32,
    pub max_pd: i32,
    pub max_qp_rd_atom: i32,
    pub max_ee_rd_atom: i32,
    pub max_res_rd_atom: i32,
    pub max_qp_init_rd_atom: i32,
    /// From `max_ee_init_rd_atom` to `max_srq_sge`: 15 fields the shim
    /// leaves at zero.
    pub _rest: [i32; 16],
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
    pub _pad: u32,
}

/// The first 48 bytes of `struct ibv_port_attr`: what the exported
/// `ibv_query_port` writes (a caller may pass the older, shorter struct).
#[repr(C)]
pub struct IbvPortAttrCompat {
    pub state: i32,
    pub max_mtu: i32,
    pub active_mtu: i32,
    pub gid_tbl_len: i32,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
}

/// `struct ibv_gid_entry`.
#[repr(C)]
pub struct IbvGidEntry {
    pub gid: [u8; 16],
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

const _: () = {
    assert!(size_of::<IbvDevice>() == 664);
    assert!(size_of::<IbvContextOps>() == 256);
    assert!(size_of::<IbvContext>() == 328);
    assert!(std::mem::offset_of!(IbvContext, cmd_fd) == 264);
    assert!(std::mem::offset_of!(IbvContext, mutex) == 280);
    assert!(std::mem::offset_of!(IbvContext, abi_compat) == 320);
    assert!(size_of::<IbvDeviceAttr>() == 232);
    assert!(std::mem::offset_of!(IbvDeviceAttr, max_qp) == 108);
    assert!(std::mem::offset_of!(IbvDeviceAttr, max_pkeys) == 224);
    assert!(std::mem::offset_of!(IbvDeviceAttr, phys_port_cnt) == 227);
    assert!(size_of::<IbvPortAttrCompat>() == 48);
    assert!(std::mem::offset_of!(IbvPortAttrCompat, link_layer) == 46);
    assert!(size_of::<IbvGidEntry>() == 32);
};

/// `struct ibv_pd`.
#[repr(C)]
pub struct IbvPd {
    pub context: *mut IbvContext,
    pub handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct IbvMr {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct IbvCompChannel {
    pub context: *mut IbvContext,
    pub fd: i32,
    pub refcnt: i32,
}

/// `struct ibv_cq`.
#[repr(C)]
pub struct IbvCq {
    pub context: *mut IbvContext,
    pub channel: *mut IbvCompChannel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: i32,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
pub struct IbvQp {
    pub context: *mut IbvContext,
    pub qp_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: i32,
    pub qp_type: i32,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvSge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `struct ibv_send_wr`: the `rdma` member of its `wr` union named, the
/// rest kept at its size.
#[repr(C)]
pub struct IbvSendWr {
    pub wr_id: u64,
    pub next: *mut IbvSendWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: i32,
    pub opcode: i32,
    pub send_flags: u32,
    /// Big endian.
    pub imm_data: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub _wr_rest: [u32; 5],
    pub _qp_type: u32,
    pub _pad: u32,
    pub _tail: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct IbvRecvWr {
    pub wr_id: u64,
    pub next: *mut IbvRecvWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: i32,
    pub _pad: i32,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct IbvWc {
    pub wr_id: u64,
    pub status: i32,
    pub opcode: i32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Big endian.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
    pub _pad: u16,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvQpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct IbvQpInitAttr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut c_void,
    pub cap: IbvQpCap,
    pub qp_type: i32,
    pub sq_sig_all: i32,
    pub _pad: u32,
}

/// `struct ibv_global_route` (its GID as two words: `union ibv_gid`'s
/// alignment).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvGlobalRoute {
    pub dgid: [u64; 2],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub _pad: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvAhAttr {
    pub grh: IbvGlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
    pub _pad: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvQpAttr {
    pub qp_state: i32,
    pub cur_qp_state: i32,
    pub path_mtu: i32,
    pub path_mig_state: i32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: IbvQpCap,
    pub ah_attr: IbvAhAttr,
    pub alt_ah_attr: IbvAhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub _pad: u8,
    pub rate_limit: u32,
    pub _pad2: u32,
}

/// `struct ibv_async_event`: the element (a QP or CQ pointer, or a port
/// number) and the event type.
#[repr(C)]
pub struct IbvAsyncEvent {
    pub element: usize,
    pub event_type: i32,
    pub _pad: i32,
}

const _: () = {
    assert!(size_of::<IbvAsyncEvent>() == 16);
    assert!(size_of::<IbvPd>() == 16);
    assert!(size_of::<IbvMr>() == 48);
    assert!(std::mem::offset_of!(IbvMr, lkey) == 36);
    assert!(size_of::<IbvCompChannel>() == 16);
    assert!(size_of::<IbvCq>() == 128);
    assert!(std::mem::offset_of!(IbvCq, comp_events_completed) == 120);
    assert!(size_of::<IbvQp>() == 160);
    assert!(std::mem::offset_of!(IbvQp, qp_num) == 52);
    assert!(std::mem::offset_of!(IbvQp, events_completed) == 152);
    assert!(size_of::<IbvSge>() == 16);
    assert!(size_of::<IbvSendWr>() == 128);
    assert!(std::mem::offset_of!(IbvSendWr, remote_addr) == 40);
    assert!(std::mem::offset_of!(IbvSendWr, rkey) == 48);
    assert!(size_of::<IbvRecvWr>() == 32);
    assert!(size_of::<IbvWc>() == 48);
    assert!(std::mem::offset_of!(IbvWc, wc_flags) == 36);
    assert!(size_of::<IbvQpInitAttr>() == 64);
    assert!(std::mem::offset_of!(IbvQpInitAttr, qp_type) == 52);
    assert!(size_of::<IbvAhAttr>() == 32);
    assert!(size_of::<IbvQpAttr>() == 144);
    assert!(std::mem::offset_of!(IbvQpAttr, ah_attr) == 56);
    assert!(std::mem::offset_of!(IbvQpAttr, pkey_index) == 120);
    assert!(std::mem::offset_of!(IbvQpAttr, min_rnr_timer) == 128);
    assert!(std::mem::offset_of!(IbvQpAttr, rate_limit) == 136);
};
