//! The hand-checked `#[repr(C)]` subset of rdma-core's `verbs.h` that the
//! loader and the objects pass to the library: x86_64 Linux layouts, their
//! sizes and offsets asserted at compile time. Written independently of
//! the test verbs library's (so each checks the other against the
//! header); only the fields read or written here are named, the rest is
//! padding kept at its size.

use std::ffi::{c_int, c_void};

/// `struct ibv_device_attr` (232 bytes): the fields read here.
#[repr(C)]
pub(super) struct DeviceAttr {
    pub(super) fw_ver: [u8; 64],
    pub(super) node_guid: u64,
    pub(super) _middle: [u8; 152],
    /// From offset 224: `max_pkeys` (2 bytes), `local_ca_ack_delay`,
    /// `phys_port_cnt`, padding.
    pub(super) tail: [u8; 8],
}

/// `struct ibv_port_attr` (56 bytes; the exported query writes its
/// first 48).
#[repr(C)]
pub(super) struct PortAttr {
    pub(super) state: i32,
    pub(super) max_mtu: i32,
    pub(super) active_mtu: i32,
    pub(super) gid_tbl_len: i32,
    pub(super) _flags_to_phys_state: [u8; 30],
    pub(super) link_layer: u8,
    pub(super) flags: u8,
    pub(super) _tail: [u8; 8],
}

/// `struct ibv_gid_entry`.
#[repr(C)]
pub(super) struct GidEntry {
    pub(super) gid: [u8; 16],
    pub(super) gid_index: u32,
    pub(super) port_num: u32,
    pub(super) gid_type: u32,
    pub(super) ndev_ifindex: u32,
}

const _: () = {
    assert!(size_of::<DeviceAttr>() == 232);
    assert!(std::mem::offset_of!(DeviceAttr, tail) == 224);
    assert!(size_of::<PortAttr>() == 56);
    assert!(std::mem::offset_of!(PortAttr, link_layer) == 46);
    assert!(size_of::<GidEntry>() == 32);
};

/// `struct ibv_mr`.
#[repr(C)]
pub(super) struct IbvMr {
    pub(super) context: *mut c_void,
    pub(super) pd: *mut c_void,
    pub(super) addr: *mut c_void,
    pub(super) length: usize,
    pub(super) handle: u32,
    pub(super) lkey: u32,
    pub(super) rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub(super) struct IbvCompChannel {
    pub(super) context: *mut c_void,
    pub(super) fd: c_int,
    pub(super) refcnt: c_int,
}

/// The head of `struct ibv_qp` (160 bytes): its context and number.
#[repr(C)]
pub(super) struct IbvQp {
    pub(super) context: *mut c_void,
    pub(super) _pointers: [usize; 5],
    pub(super) handle: u32,
    pub(super) qp_num: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `struct ibv_send_wr` (128 bytes), its `wr.rdma` member named.
#[repr(C)]
pub(super) struct IbvSendWr {
    pub(super) wr_id: u64,
    pub(super) next: *mut IbvSendWr,
    pub(super) sg_list: *const Sge,
    pub(super) num_sge: c_int,
    pub(super) opcode: c_int,
    pub(super) send_flags: u32,
    pub(super) imm_data: u32,
    pub(super) remote_addr: u64,
    pub(super) rkey: u32,
    pub(super) _rest: [u32; 7],
    pub(super) _tail: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub(super) struct IbvRecvWr {
    pub(super) wr_id: u64,
    pub(super) next: *mut IbvRecvWr,
    pub(super) sg_list: *const Sge,
    pub(super) num_sge: c_int,
    pub(super) _pad: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct IbvWc {
    pub(super) wr_id: u64,
    pub(super) status: c_int,
    pub(super) opcode: c_int,
    pub(super) vendor_err: u32,
    pub(super) byte_len: u32,
    pub(super) imm_data: u32,
    pub(super) qp_num: u32,
    pub(super) src_qp: u32,
    pub(super) wc_flags: u32,
    pub(super) _tail: [u8; 8],
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct IbvQpCap {
    pub(super) max_send_wr: u32,
    pub(super) max_recv_wr: u32,
    pub(super) max_send_sge: u32,
    pub(super) max_recv_sge: u32,
    pub(super) max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub(super) struct IbvQpInitAttr {
    pub(super) qp_context: *mut c_void,
    pub(super) send_cq: *mut c_void,
    pub(super) recv_cq: *mut c_void,
    pub(super) srq: *mut c_void,
    pub(super) cap: IbvQpCap,
    pub(super) qp_type: c_int,
    pub(super) sq_sig_all: c_int,
    pub(super) _pad: u32,
}

/// `struct ibv_ah_attr`, its `grh` inline (the GID as two words keeps
/// `union ibv_gid`'s alignment).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct IbvAhAttr {
    pub(super) dgid: [u64; 2],
    pub(super) flow_label: u32,
    pub(super) sgid_index: u8,
    pub(super) hop_limit: u8,
    pub(super) traffic_class: u8,
    pub(super) _pad0: u8,
    pub(super) dlid: u16,
    pub(super) sl: u8,
    pub(super) src_path_bits: u8,
    pub(super) static_rate: u8,
    pub(super) is_global: u8,
    pub(super) port_num: u8,
    pub(super) _pad1: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct IbvQpAttr {
    pub(super) qp_state: c_int,
    pub(super) cur_qp_state: c_int,
    pub(super) path_mtu: c_int,
    pub(super) path_mig_state: c_int,
    pub(super) qkey: u32,
    pub(super) rq_psn: u32,
    pub(super) sq_psn: u32,
    pub(super) dest_qp_num: u32,
    pub(super) qp_access_flags: u32,
    pub(super) cap: IbvQpCap,
    pub(super) ah_attr: IbvAhAttr,
    pub(super) alt_ah_attr: IbvAhAttr,
    pub(super) pkey_index: u16,
    pub(super) alt_pkey_index: u16,
    pub(super) en_sqd_async_notify: u8,
    pub(super) sq_draining: u8,
    pub(super) max_rd_atomic: u8,
    pub(super) max_dest_rd_atomic: u8,
    pub(super) min_rnr_timer: u8,
    pub(super) port_num: u8,
    pub(super) timeout: u8,
    pub(super) retry_cnt: u8,
    pub(super) rnr_retry: u8,
    pub(super) alt_port_num: u8,
    pub(super) alt_timeout: u8,
    pub(super) _pad: u8,
    pub(super) rate_limit: u32,
    pub(super) _pad2: u32,
}

const _: () = {
    assert!(size_of::<IbvMr>() == 48);
    assert!(std::mem::offset_of!(IbvMr, lkey) == 36);
    assert!(size_of::<IbvCompChannel>() == 16);
    assert!(std::mem::offset_of!(IbvQp, qp_num) == 52);
    assert!(size_of::<IbvSendWr>() == 128);
    assert!(std::mem::offset_of!(IbvSendWr, remote_addr) == 40);
    assert!(std::mem::offset_of!(IbvSendWr, rkey) == 48);
    assert!(size_of::<IbvRecvWr>() == 32);
    assert!(size_of::<IbvWc>() == 48);
    assert!(size_of::<IbvQpInitAttr>() == 64);
    assert!(size_of::<IbvAhAttr>() == 32);
    assert!(size_of::<IbvQpAttr>() == 144);
    assert!(std::mem::offset_of!(IbvQpAttr, ah_attr) == 56);
    assert!(std::mem::offset_of!(IbvQpAttr, min_rnr_timer) == 128);
};

/// `struct ibv_async_event`: the element (a QP or CQ pointer, or a port
/// number) and the event type.
#[repr(C)]
pub(super) struct IbvAsyncEvent {
    pub(super) element: usize,
    pub(super) event_type: c_int,
    pub(super) _pad: c_int,
}

const _: () = assert!(size_of::<IbvAsyncEvent>() == 16);
