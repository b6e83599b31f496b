//! AWS EFA: SRD queue pairs through libefa (efadv), loaded at run time like libibverbs.
//!
//! SRD is reliable but unordered, so the transport runs its sequenced protocol over it
//! (mod.rs): data as RDMA WRITE with immediate, signals as SEND with immediate, every work
//! request signaled. EFA builds RDMA writes only through the ibv_wr_* interface
//! (`struct ibv_qp_ex`), whose calls are inline function pointers (`abi::QPX_*`). An SRD
//! queue pair is connectionless: each peer is reached through an address handle made from
//! its GID, the peer's queue pair number and a queue key both sides share (`QKEY`).

use super::abi::*;
use super::ibverbs::VerbsLibrary;
use super::verbs::{WorkOp, WorkRequest, SIGNAL_MESSAGE_BYTES};
use crate::error::{MkError, Result};
use libloading::Library;
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

type Ptr = *mut c_void;

/// The queue key every mkernel SRD queue pair uses.
pub const QKEY: u32 = 0x4d4b_0001;

#[derive(Clone, Copy)]
pub struct EfaFunctions {
    pub create_qp_ex: unsafe extern "C" fn(Ptr, *mut ibv_qp_init_attr_ex, *mut efadv_qp_init_attr, u32) -> Ptr,
    pub query_device: unsafe extern "C" fn(Ptr, *mut u8, u32) -> c_int,
}

impl EfaFunctions {
    /// libefa's entry points, or None where libefa.so.1 is missing.
    pub fn load() -> Option<(EfaFunctions, Library)> {
        // SAFETY: loading libefa runs no code with effects beyond its own state.
        let lib = unsafe { Library::new("libefa.so.1") }.ok()?;
        // SAFETY: the prototypes are efadv.h's; the library outlives the table.
        let f = unsafe {
            EfaFunctions {
                create_qp_ex: *lib.get(b"efadv_create_qp_ex\0").ok()?,
                query_device: *lib.get(b"efadv_query_device\0").ok()?,
            }
        };
        Some((f, lib))
    }
}

/// What the EFA device offers.
pub struct EfaDevice {
    pub max_sq_wr: u32,
    pub max_rq_wr: u32,
    pub caps: u32,
    /// Bytes one RDMA operation may carry.
    pub max_rdma_size: u32,
}

/// The EFA attributes of an open device, or None when it is not an EFA device (or libefa
/// is missing).
pub fn query_device(lib: &VerbsLibrary, ctx: Ptr) -> Option<EfaDevice> {
    let efa = lib.efa?;
    let mut attr = [0u64; EFA_DEVICE_ATTR_BYTES / 8];
    // SAFETY: inlen tells libefa how many bytes it may fill; it fails on non-EFA devices.
    if unsafe { (efa.query_device)(ctx, attr.as_mut_ptr().cast(), EFA_DEVICE_ATTR_BYTES as u32) } != 0 {
        return None;
    }
    let p = attr.as_ptr().cast::<u8>();
    // SAFETY: offsets inside efadv_device_attr (abi).
    let read = |at: usize| unsafe { std::ptr::read_unaligned(p.add(at).cast::<u32>()) };
    Some(EfaDevice {
        max_sq_wr: read(EFA_MAX_SQ_WR),
        max_rq_wr: read(EFA_MAX_RQ_WR),
        caps: read(EFA_DEVICE_CAPS),
        max_rdma_size: read(EFA_MAX_RDMA_SIZE),
    })
}

/// Creates an SRD queue pair (reset state) able to post RDMA writes and sends with
/// immediate data.
pub fn create_srd_qp(
    lib: &VerbsLibrary,
    ctx: Ptr,
    pd: Ptr,
    cq: Ptr,
    send_depth: u32,
    receive_depth: u32,
) -> Result<Ptr> {
    let efa = lib.efa.ok_or_else(|| MkError::system("libefa.so.1 did not load"))?;
    let mut init = ibv_qp_init_attr_ex {
        qp_context: null_mut(),
        send_cq: cq,
        recv_cq: cq,
        srq: null_mut(),
        cap: ibv_qp_cap {
            max_send_wr: send_depth,
            max_recv_wr: receive_depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: SIGNAL_MESSAGE_BYTES as u32,
        },
        qp_type: IBV_QPT_DRIVER,
        sq_sig_all: 0,
        comp_mask: IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
        pd,
        xrcd: null_mut(),
        create_flags: 0,
        max_tso_header: 0,
        rwq_ind_tbl: null_mut(),
        rx_hash_function: 0,
        rx_hash_key_len: 0,
        rx_hash_key: null_mut(),
        rx_hash_fields_mask: 0,
        source_qpn: 0,
        send_ops_flags: IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND_WITH_IMM,
    };
    let mut efa_attr = efadv_qp_init_attr { comp_mask: 0, driver_qp_type: EFADV_QP_DRIVER_TYPE_SRD, reserved: [0; 4] };
    // SAFETY: both attribute structs are filled; inlen is the size of efa_attr.
    let qp =
        unsafe { (efa.create_qp_ex)(ctx, &mut init, &mut efa_attr, std::mem::size_of::<efadv_qp_init_attr>() as u32) };
    if qp.is_null() {
        return Err(MkError::system(format!("efadv_create_qp_ex (SRD) failed: {}", std::io::Error::last_os_error())));
    }
    Ok(qp)
}

/// Moves an SRD queue pair to RTS (SRD needs no peer to do so: peers are per request).
pub fn bring_up(lib: &VerbsLibrary, qp: Ptr, port: u8, psn: u32, rnr_retry: bool) -> Result<()> {
    let steps: [(ibv_qp_attr, c_int, &str); 3] = [
        (
            ibv_qp_attr { qp_state: IBV_QPS_INIT, port_num: port, qkey: QKEY, ..Default::default() },
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY,
            "INIT",
        ),
        (ibv_qp_attr { qp_state: IBV_QPS_RTR, ..Default::default() }, IBV_QP_STATE, "RTR"),
        (
            // rnr_retry 7: a message waits (retried by the device) while the peer has no
            // receive posted, instead of failing.
            ibv_qp_attr { qp_state: IBV_QPS_RTS, sq_psn: psn, rnr_retry: 7, ..Default::default() },
            IBV_QP_STATE | IBV_QP_SQ_PSN | if rnr_retry { IBV_QP_RNR_RETRY } else { 0 },
            "RTS",
        ),
    ];
    for (mut attr, mask, what) in steps {
        // SAFETY: qp is live; attr is filled for the fields in mask.
        let r = unsafe { (lib.modify_qp)(qp, &mut attr, mask) };
        if r != 0 {
            return Err(MkError::system(format!(
                "ibv_modify_qp of an SRD queue pair to {what} failed: {}",
                std::io::Error::from_raw_os_error(r)
            )));
        }
    }
    Ok(())
}

/// Posts one work request on an SRD queue pair through the ibv_wr_* interface; returns
/// 0 or an errno (ENOMEM when the send queue is full).
///
/// # Safety
/// `qpx` is the ibv_qp_ex view of a live SRD queue pair in RTS and `ah` a live address
/// handle of the peer whose queue pair is `remote_qp`.
pub unsafe fn post(qpx: Ptr, ah: Ptr, remote_qp: u32, wr: &WorkRequest) -> c_int {
    let base = qpx.cast::<u8>();
    macro_rules! call {
        ($offset:expr, fn($($t:ty),*) -> $r:ty, $($arg:expr),*) => {{
            // SAFETY: the provider installed this ibv_qp_ex member (abi offset).
            let f: unsafe extern "C" fn(Ptr $(, $t)*) -> $r = unsafe { std::ptr::read_unaligned(base.add($offset).cast()) };
            // SAFETY: arguments as verbs.h's inline wrapper passes them.
            unsafe { f(qpx $(, $arg)*) }
        }};
    }
    let mut flags = if wr.signaled { IBV_SEND_SIGNALED } else { 0 };
    call!(QPX_START, fn() -> (),);
    // SAFETY: wr_id and wr_flags are plain members of ibv_qp_ex, set before each request.
    unsafe {
        std::ptr::write_unaligned(base.add(QPX_WR_ID).cast::<u64>(), wr.id);
    }
    match wr.op {
        WorkOp::Write { local_addr, lkey, bytes, remote_addr, rkey, imm } => {
            // SAFETY: as above.
            unsafe { std::ptr::write_unaligned(base.add(QPX_WR_FLAGS).cast::<u32>(), flags) };
            match imm {
                Some(imm) => call!(QPX_RDMA_WRITE_IMM, fn(u32, u64, u32) -> (), rkey, remote_addr, imm.to_be()),
                None => call!(QPX_RDMA_WRITE, fn(u32, u64) -> (), rkey, remote_addr),
            }
            call!(QPX_SET_UD_ADDR, fn(Ptr, u32, u32) -> (), ah, remote_qp, QKEY);
            call!(QPX_SET_SGE, fn(u32, u64, u32) -> (), lkey, local_addr, bytes);
        }
        WorkOp::Send { payload, imm } => {
            flags |= IBV_SEND_INLINE;
            // Inline data is copied by wr_set_inline_data, so a local copy suffices.
            let mut inline = payload;
            // SAFETY: as above.
            unsafe { std::ptr::write_unaligned(base.add(QPX_WR_FLAGS).cast::<u32>(), flags) };
            call!(QPX_SEND_IMM, fn(u32) -> (), imm.to_be());
            call!(QPX_SET_UD_ADDR, fn(Ptr, u32, u32) -> (), ah, remote_qp, QKEY);
            call!(QPX_SET_INLINE_DATA, fn(*mut c_void, usize) -> (), inline.as_mut_ptr().cast(), inline.len());
        }
        WorkOp::WriteValue { .. } => {
            call!(QPX_ABORT, fn() -> (),);
            // The sequenced protocol never writes a bare value: nothing would order it.
            return libc::EINVAL;
        }
    }
    call!(QPX_COMPLETE, fn() -> c_int,)
}
