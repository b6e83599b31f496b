//! The few libibverbs/libefa data structures the run-time-loaded verbs layer fills or
//! reads, declared here rather than taken from rdma-sys: rdma-sys links libibverbs (so the
//! library would not load without it) and needs its headers to build. Layouts follow
//! rdma-core's verbs.h and efadv.h, which keep them stable (an ABI promise for providers);
//! `tests/rdma_abi.rs` compares every size and offset with the installed headers where
//! they exist.
//!
//! Structures only read, never filled (ibv_context, ibv_qp, ibv_mr, ibv_port_attr,
//! ibv_device_attr, ibv_qp_ex, efadv_device_attr), are read at fixed offsets instead.
//!
//! Several verbs "functions" are static inline wrappers in verbs.h over function pointers
//! the provider installs: ibv_post_send, ibv_post_recv and ibv_poll_cq call through
//! `context->ops`, and the ibv_wr_* calls through `struct ibv_qp_ex`. No library exports
//! them, so the layer calls those pointers itself (`OPS_*` and `QPX_*` below).

#![allow(non_camel_case_types)]

use std::ffi::c_void;

/// Offset of `ops` in struct ibv_context, and of three members of struct ibv_context_ops.
pub const CONTEXT_OPS: usize = 8;
pub const OPS_POLL_CQ: usize = 88;
pub const OPS_POST_SEND: usize = 200;
pub const OPS_POST_RECV: usize = 208;
/// struct ibv_qp: qp_num.
pub const QP_NUM: usize = 52;
/// struct ibv_mr: lkey, rkey.
pub const MR_LKEY: usize = 36;
pub const MR_RKEY: usize = 40;
/// struct ibv_port_attr (compat prefix): state, active_mtu, lid, link_layer.
pub const PORT_STATE: usize = 0;
pub const PORT_ACTIVE_MTU: usize = 8;
pub const PORT_LID: usize = 34;
pub const PORT_LINK_LAYER: usize = 46;
/// Bytes to allocate for ibv_port_attr and ibv_device_attr (larger than any version's).
pub const PORT_ATTR_ROOM: usize = 128;
pub const DEVICE_ATTR_ROOM: usize = 512;
/// struct ibv_device_attr: max_qp_wr, phys_port_cnt.
pub const DEVICE_MAX_QP_WR: usize = 112;
pub const DEVICE_PHYS_PORT_CNT: usize = 227;
/// struct ibv_qp_ex: wr_id, wr_flags, and the work-request builders.
pub const QPX_WR_ID: usize = 168;
pub const QPX_WR_FLAGS: usize = 176;
pub const QPX_RDMA_WRITE: usize = 224;
pub const QPX_RDMA_WRITE_IMM: usize = 232;
pub const QPX_SEND_IMM: usize = 248;
pub const QPX_SET_UD_ADDR: usize = 272;
pub const QPX_SET_INLINE_DATA: usize = 288;
pub const QPX_SET_SGE: usize = 304;
pub const QPX_START: usize = 320;
pub const QPX_COMPLETE: usize = 328;
pub const QPX_ABORT: usize = 336;
/// struct efadv_device_attr: max_sq_wr, max_rq_wr, device_caps, max_rdma_size; its size.
pub const EFA_MAX_SQ_WR: usize = 8;
pub const EFA_MAX_RQ_WR: usize = 12;
pub const EFA_DEVICE_CAPS: usize = 24;
pub const EFA_MAX_RDMA_SIZE: usize = 28;
pub const EFA_DEVICE_ATTR_BYTES: usize = 32;

pub const IBV_PORT_ACTIVE: u32 = 4;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;
pub const IBV_QPT_RC: u32 = 2;
pub const IBV_QPT_DRIVER: u32 = 255;
pub const EFADV_QP_DRIVER_TYPE_SRD: u32 = 0;
pub const EFADV_DEVICE_ATTR_CAPS_RNR_RETRY: u32 = 1 << 1;
pub const EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE: u32 = 1 << 3;
pub const IBV_QP_INIT_ATTR_PD: u32 = 1;
pub const IBV_QP_INIT_ATTR_SEND_OPS_FLAGS: u32 = 64;
pub const IBV_QP_EX_WITH_RDMA_WRITE: u64 = 1;
pub const IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM: u64 = 2;
pub const IBV_QP_EX_WITH_SEND_WITH_IMM: u64 = 8;
pub const IBV_WR_RDMA_WRITE: u32 = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: u32 = 1;
pub const IBV_WR_SEND_WITH_IMM: u32 = 3;
pub const IBV_SEND_SIGNALED: u32 = 2;
pub const IBV_SEND_INLINE: u32 = 8;
pub const IBV_WC_RECV: u32 = 128;
pub const IBV_WC_RECV_RDMA_WITH_IMM: u32 = 129;
pub const IBV_ACCESS_LOCAL_WRITE: i32 = 1;
pub const IBV_ACCESS_REMOTE_WRITE: i32 = 2;
pub const IBV_ACCESS_REMOTE_READ: i32 = 4;
pub const IBV_QPS_INIT: u32 = 1;
pub const IBV_QPS_RTR: u32 = 2;
pub const IBV_QPS_RTS: u32 = 3;
pub const IBV_QP_STATE: i32 = 1;
pub const IBV_QP_ACCESS_FLAGS: i32 = 8;
pub const IBV_QP_PKEY_INDEX: i32 = 16;
pub const IBV_QP_PORT: i32 = 32;
pub const IBV_QP_QKEY: i32 = 64;
pub const IBV_QP_AV: i32 = 128;
pub const IBV_QP_PATH_MTU: i32 = 256;
pub const IBV_QP_TIMEOUT: i32 = 512;
pub const IBV_QP_RETRY_CNT: i32 = 1024;
pub const IBV_QP_RNR_RETRY: i32 = 2048;
pub const IBV_QP_RQ_PSN: i32 = 4096;
pub const IBV_QP_MAX_QP_RD_ATOMIC: i32 = 8192;
pub const IBV_QP_MIN_RNR_TIMER: i32 = 32768;
pub const IBV_QP_SQ_PSN: i32 = 65536;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: i32 = 131072;
pub const IBV_QP_DEST_QPN: i32 = 1048576;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// ibv_send_wr with its `wr` union as the `rdma` member (remote_addr, rkey) padded to the
/// union's 32 bytes, and the members after it (xrc, bind_mw/tso) as padding.
#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: i32,
    pub opcode: u32,
    pub send_flags: u32,
    /// Network byte order.
    pub imm_data: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub _wr_rest: [u32; 5],
    pub _tail: [u64; 7],
}

#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Network byte order.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut c_void,
    pub recv_cq: *mut c_void,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: i32,
}

#[repr(C)]
pub struct ibv_qp_init_attr_ex {
    pub qp_context: *mut c_void,
    pub send_cq: *mut c_void,
    pub recv_cq: *mut c_void,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: i32,
    pub comp_mask: u32,
    pub pd: *mut c_void,
    pub xrcd: *mut c_void,
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut c_void,
    pub rx_hash_function: u8,
    pub rx_hash_key_len: u8,
    pub rx_hash_key: *mut u8,
    pub rx_hash_fields_mask: u64,
    pub source_qpn: u32,
    pub send_ops_flags: u64,
}

#[repr(C)]
pub struct efadv_qp_init_attr {
    pub comp_mask: u64,
    pub driver_qp_type: u32,
    pub reserved: [u8; 4],
}

/// ibv_global_route (its ibv_gid union holds two u64s, hence the alignment).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_global_route {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_qp_attr {
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
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
    pub rate_limit: u32,
}

/// (name, size or offset) of every declared layout fact, for the header comparison test.
pub fn layout_facts() -> Vec<(&'static str, usize)> {
    use std::mem::{offset_of, size_of};
    vec![
        ("ibv_context.ops", CONTEXT_OPS),
        ("ibv_context_ops.poll_cq", OPS_POLL_CQ),
        ("ibv_context_ops.post_send", OPS_POST_SEND),
        ("ibv_context_ops.post_recv", OPS_POST_RECV),
        ("ibv_qp.qp_num", QP_NUM),
        ("ibv_mr.lkey", MR_LKEY),
        ("ibv_mr.rkey", MR_RKEY),
        ("ibv_port_attr.state", PORT_STATE),
        ("ibv_port_attr.active_mtu", PORT_ACTIVE_MTU),
        ("ibv_port_attr.lid", PORT_LID),
        ("ibv_port_attr.link_layer", PORT_LINK_LAYER),
        ("ibv_device_attr.max_qp_wr", DEVICE_MAX_QP_WR),
        ("ibv_device_attr.phys_port_cnt", DEVICE_PHYS_PORT_CNT),
        ("ibv_qp_ex.wr_id", QPX_WR_ID),
        ("ibv_qp_ex.wr_flags", QPX_WR_FLAGS),
        ("ibv_qp_ex.wr_rdma_write", QPX_RDMA_WRITE),
        ("ibv_qp_ex.wr_rdma_write_imm", QPX_RDMA_WRITE_IMM),
        ("ibv_qp_ex.wr_send_imm", QPX_SEND_IMM),
        ("ibv_qp_ex.wr_set_ud_addr", QPX_SET_UD_ADDR),
        ("ibv_qp_ex.wr_set_inline_data", QPX_SET_INLINE_DATA),
        ("ibv_qp_ex.wr_set_sge", QPX_SET_SGE),
        ("ibv_qp_ex.wr_start", QPX_START),
        ("ibv_qp_ex.wr_complete", QPX_COMPLETE),
        ("ibv_qp_ex.wr_abort", QPX_ABORT),
        ("efadv_device_attr.max_sq_wr", EFA_MAX_SQ_WR),
        ("efadv_device_attr.max_rq_wr", EFA_MAX_RQ_WR),
        ("efadv_device_attr.device_caps", EFA_DEVICE_CAPS),
        ("efadv_device_attr.max_rdma_size", EFA_MAX_RDMA_SIZE),
        ("sizeof efadv_device_attr", EFA_DEVICE_ATTR_BYTES),
        ("sizeof ibv_sge", size_of::<ibv_sge>()),
        ("sizeof ibv_send_wr", size_of::<ibv_send_wr>()),
        ("ibv_send_wr.opcode", offset_of!(ibv_send_wr, opcode)),
        ("ibv_send_wr.send_flags", offset_of!(ibv_send_wr, send_flags)),
        ("ibv_send_wr.imm_data", offset_of!(ibv_send_wr, imm_data)),
        ("ibv_send_wr.wr.rdma.remote_addr", offset_of!(ibv_send_wr, remote_addr)),
        ("ibv_send_wr.wr.rdma.rkey", offset_of!(ibv_send_wr, rkey)),
        ("ibv_recv_wr.num_sge", offset_of!(ibv_recv_wr, num_sge)),
        ("sizeof ibv_recv_wr", size_of::<ibv_recv_wr>()),
        ("sizeof ibv_wc", size_of::<ibv_wc>()),
        ("ibv_wc.status", offset_of!(ibv_wc, status)),
        ("ibv_wc.opcode", offset_of!(ibv_wc, opcode)),
        ("ibv_wc.imm_data", offset_of!(ibv_wc, imm_data)),
        ("ibv_wc.qp_num", offset_of!(ibv_wc, qp_num)),
        ("ibv_wc.wc_flags", offset_of!(ibv_wc, wc_flags)),
        ("sizeof ibv_qp_cap", size_of::<ibv_qp_cap>()),
        ("sizeof ibv_qp_init_attr", size_of::<ibv_qp_init_attr>()),
        ("ibv_qp_init_attr.cap", offset_of!(ibv_qp_init_attr, cap)),
        ("ibv_qp_init_attr.qp_type", offset_of!(ibv_qp_init_attr, qp_type)),
        ("ibv_qp_init_attr.sq_sig_all", offset_of!(ibv_qp_init_attr, sq_sig_all)),
        ("sizeof ibv_qp_init_attr_ex", size_of::<ibv_qp_init_attr_ex>()),
        ("ibv_qp_init_attr_ex.comp_mask", offset_of!(ibv_qp_init_attr_ex, comp_mask)),
        ("ibv_qp_init_attr_ex.pd", offset_of!(ibv_qp_init_attr_ex, pd)),
        ("ibv_qp_init_attr_ex.source_qpn", offset_of!(ibv_qp_init_attr_ex, source_qpn)),
        ("ibv_qp_init_attr_ex.send_ops_flags", offset_of!(ibv_qp_init_attr_ex, send_ops_flags)),
        ("sizeof efadv_qp_init_attr", size_of::<efadv_qp_init_attr>()),
        ("efadv_qp_init_attr.driver_qp_type", offset_of!(efadv_qp_init_attr, driver_qp_type)),
        ("sizeof ibv_global_route", size_of::<ibv_global_route>()),
        ("ibv_global_route.sgid_index", offset_of!(ibv_global_route, sgid_index)),
        ("ibv_global_route.hop_limit", offset_of!(ibv_global_route, hop_limit)),
        ("sizeof ibv_ah_attr", size_of::<ibv_ah_attr>()),
        ("ibv_ah_attr.dlid", offset_of!(ibv_ah_attr, dlid)),
        ("ibv_ah_attr.is_global", offset_of!(ibv_ah_attr, is_global)),
        ("ibv_ah_attr.port_num", offset_of!(ibv_ah_attr, port_num)),
        ("sizeof ibv_qp_attr", size_of::<ibv_qp_attr>()),
        ("ibv_qp_attr.qkey", offset_of!(ibv_qp_attr, qkey)),
        ("ibv_qp_attr.dest_qp_num", offset_of!(ibv_qp_attr, dest_qp_num)),
        ("ibv_qp_attr.qp_access_flags", offset_of!(ibv_qp_attr, qp_access_flags)),
        ("ibv_qp_attr.ah_attr", offset_of!(ibv_qp_attr, ah_attr)),
        ("ibv_qp_attr.pkey_index", offset_of!(ibv_qp_attr, pkey_index)),
        ("ibv_qp_attr.max_dest_rd_atomic", offset_of!(ibv_qp_attr, max_dest_rd_atomic)),
        ("ibv_qp_attr.port_num", offset_of!(ibv_qp_attr, port_num)),
        ("ibv_qp_attr.rnr_retry", offset_of!(ibv_qp_attr, rnr_retry)),
    ]
}

/// (name, value) of every declared constant, for the header comparison test.
pub fn constant_facts() -> Vec<(&'static str, i64)> {
    vec![
        ("IBV_PORT_ACTIVE", IBV_PORT_ACTIVE as i64),
        ("IBV_LINK_LAYER_ETHERNET", IBV_LINK_LAYER_ETHERNET as i64),
        ("IBV_QPT_RC", IBV_QPT_RC as i64),
        ("IBV_QPT_DRIVER", IBV_QPT_DRIVER as i64),
        ("EFADV_QP_DRIVER_TYPE_SRD", EFADV_QP_DRIVER_TYPE_SRD as i64),
        ("EFADV_DEVICE_ATTR_CAPS_RNR_RETRY", EFADV_DEVICE_ATTR_CAPS_RNR_RETRY as i64),
        ("IBV_QP_INIT_ATTR_PD", IBV_QP_INIT_ATTR_PD as i64),
        ("IBV_QP_INIT_ATTR_SEND_OPS_FLAGS", IBV_QP_INIT_ATTR_SEND_OPS_FLAGS as i64),
        ("IBV_QP_EX_WITH_RDMA_WRITE", IBV_QP_EX_WITH_RDMA_WRITE as i64),
        ("IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM", IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM as i64),
        ("IBV_QP_EX_WITH_SEND_WITH_IMM", IBV_QP_EX_WITH_SEND_WITH_IMM as i64),
        ("IBV_WR_RDMA_WRITE", IBV_WR_RDMA_WRITE as i64),
        ("IBV_WR_RDMA_WRITE_WITH_IMM", IBV_WR_RDMA_WRITE_WITH_IMM as i64),
        ("IBV_WR_SEND_WITH_IMM", IBV_WR_SEND_WITH_IMM as i64),
        ("IBV_SEND_SIGNALED", IBV_SEND_SIGNALED as i64),
        ("IBV_SEND_INLINE", IBV_SEND_INLINE as i64),
        ("IBV_WC_RECV", IBV_WC_RECV as i64),
        ("IBV_WC_RECV_RDMA_WITH_IMM", IBV_WC_RECV_RDMA_WITH_IMM as i64),
        ("IBV_ACCESS_LOCAL_WRITE", IBV_ACCESS_LOCAL_WRITE as i64),
        ("IBV_ACCESS_REMOTE_WRITE", IBV_ACCESS_REMOTE_WRITE as i64),
        ("IBV_ACCESS_REMOTE_READ", IBV_ACCESS_REMOTE_READ as i64),
        ("IBV_QPS_INIT", IBV_QPS_INIT as i64),
        ("IBV_QPS_RTR", IBV_QPS_RTR as i64),
        ("IBV_QPS_RTS", IBV_QPS_RTS as i64),
        ("IBV_QP_STATE", IBV_QP_STATE as i64),
        ("IBV_QP_ACCESS_FLAGS", IBV_QP_ACCESS_FLAGS as i64),
        ("IBV_QP_PKEY_INDEX", IBV_QP_PKEY_INDEX as i64),
        ("IBV_QP_PORT", IBV_QP_PORT as i64),
        ("IBV_QP_QKEY", IBV_QP_QKEY as i64),
        ("IBV_QP_AV", IBV_QP_AV as i64),
        ("IBV_QP_PATH_MTU", IBV_QP_PATH_MTU as i64),
        ("IBV_QP_TIMEOUT", IBV_QP_TIMEOUT as i64),
        ("IBV_QP_RETRY_CNT", IBV_QP_RETRY_CNT as i64),
        ("IBV_QP_RNR_RETRY", IBV_QP_RNR_RETRY as i64),
        ("IBV_QP_RQ_PSN", IBV_QP_RQ_PSN as i64),
        ("IBV_QP_MAX_QP_RD_ATOMIC", IBV_QP_MAX_QP_RD_ATOMIC as i64),
        ("IBV_QP_MIN_RNR_TIMER", IBV_QP_MIN_RNR_TIMER as i64),
        ("IBV_QP_SQ_PSN", IBV_QP_SQ_PSN as i64),
        ("IBV_QP_MAX_DEST_RD_ATOMIC", IBV_QP_MAX_DEST_RD_ATOMIC as i64),
        ("IBV_QP_DEST_QPN", IBV_QP_DEST_QPN as i64),
    ]
}
