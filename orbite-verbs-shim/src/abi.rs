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
