//! RDMA transport over ibverbs (rdma-sys), built with the cargo feature `rdma`.
//!
//! One RC queue pair per peer on one (device, port) chosen by `MK_IB_HCA`; one send CQ.
//! A put is an RDMA WRITE of the data followed, on the same QP, by an 8-byte inline RDMA
//! WRITE of the signal value: RC executes a QP's writes in order at the responder, so the
//! signal lands after the data. Only the last work request of a put is signalled (its
//! completion implies the earlier ones'). Windows in device memory are registered through
//! dmabuf (cuMemGetHandleForAddressRange → ibv_reg_dmabuf_mr), falling back to ibv_reg_mr
//! (which needs nvidia_peermem); host windows through ibv_reg_mr.
//!
//! EFA's SRD transport does not order a QP's writes, so there a put must be a
//! WRITE_WITH_IMM that the receiving proxy turns into the signal write. That receive path
//! is not written yet: on an EFA device this transport refuses to start and says to use
//! MK_NET=socket.
//!
//! Honesty note: this code compiles and its pure parts (connection data, work-request
//! planning, device selection) are unit-tested, but no machine it was developed on has an
//! RDMA device: the verbs path has never run on real hardware.

use super::{PutRequest, Window};
use crate::error::{MkError, Result};

const BLOB_MAGIC: &[u8; 4] = b"MKR1";
/// Largest single RDMA WRITE we post (IB's limit is 2^31 bytes).
pub const MAX_WRITE_BYTES: u64 = 1 << 30;

/// A registered region as peers address it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteRegion {
    pub addr: u64,
    pub rkey: u32,
    pub bytes: u64,
}

/// What peers need to reach this rank over RDMA: its port address, its window's keys, and
/// the number of the QP it created for each rank (0 where it has none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaBlob {
    pub lid: u16,
    pub gid: [u8; 16],
    /// ibv_mtu value of the port's active MTU.
    pub mtu: u32,
    /// First packet sequence number of this rank's QPs.
    pub psn: u32,
    pub data: RemoteRegion,
    pub signals: RemoteRegion,
    pub qp_nums: Vec<u32>,
}

impl RdmaBlob {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(64 + 4 * self.qp_nums.len());
        v.extend_from_slice(BLOB_MAGIC);
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.extend_from_slice(&self.gid);
        v.extend_from_slice(&self.mtu.to_le_bytes());
        v.extend_from_slice(&self.psn.to_le_bytes());
        for r in [self.data, self.signals] {
            v.extend_from_slice(&r.addr.to_le_bytes());
            v.extend_from_slice(&r.rkey.to_le_bytes());
            v.extend_from_slice(&r.bytes.to_le_bytes());
        }
        v.extend_from_slice(&(self.qp_nums.len() as u32).to_le_bytes());
        for q in &self.qp_nums {
            v.extend_from_slice(&q.to_le_bytes());
        }
        v
    }

    pub fn decode(b: &[u8], from_rank: usize) -> Result<RdmaBlob> {
        let bad = || {
            MkError::remote(format!(
                "rank {from_rank} sent no RDMA connection data ({} bytes): do all ranks use the same MK_NET and the \
                 same mkernel build?",
                b.len()
            ))
        };
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8]> {
            let s = b.get(at..at + n).ok_or_else(bad)?;
            at += n;
            Ok(s)
        };
        if take(4)? != BLOB_MAGIC {
            return Err(bad());
        }
        let u16_le = |s: &[u8]| u16::from_le_bytes(s.try_into().expect("2 bytes"));
        let u32_le = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes"));
        let u64_le = |s: &[u8]| u64::from_le_bytes(s.try_into().expect("8 bytes"));
        let lid = u16_le(take(2)?);
        let gid: [u8; 16] = take(16)?.try_into().expect("16 bytes");
        let mtu = u32_le(take(4)?);
        let psn = u32_le(take(4)?);
        let mut regions = [RemoteRegion::default(); 2];
        for r in &mut regions {
            *r = RemoteRegion { addr: u64_le(take(8)?), rkey: u32_le(take(4)?), bytes: u64_le(take(8)?) };
        }
        let count = u32_le(take(4)?) as usize;
        if count > 1 << 24 {
            return Err(bad());
        }
        let qp_nums = (0..count).map(|_| take(4).map(u32_le)).collect::<Result<Vec<_>>>()?;
        if at != b.len() {
            return Err(bad());
        }
        Ok(RdmaBlob { lid, gid, mtu, psn, data: regions[0], signals: regions[1], qp_nums })
    }
}

/// How a device keeps a put's signal behind its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalOrdering {
    /// RC: the QP's writes land in order, so a second WRITE carries the signal.
    WriteThenFlag,
    /// SRD (EFA): unordered; the data WRITE carries the signal id as immediate data.
    WriteWithImm,
}

/// The ordering a device needs, from its name (EFA devices are named efa_N).
pub fn signal_ordering_for_device(name: &str) -> SignalOrdering {
    if name.starts_with("efa") {
        SignalOrdering::WriteWithImm
    } else {
        SignalOrdering::WriteThenFlag
    }
}

/// One RDMA WRITE of a put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteStep {
    /// `bytes` from local data offset `src_offset` to the remote address.
    Data { src_offset: u64, remote_addr: u64, rkey: u32, bytes: u64 },
    /// The 8-byte signal value, inline, to the remote signal word.
    Flag { value: u64, remote_addr: u64, rkey: u32 },
}

/// The writes of a put in posting order (data in chunks of at most `MAX_WRITE_BYTES`, then
/// the flag); the last one is the one to signal. Ranges must already be checked.
pub fn plan_put(put: &PutRequest, remote: &RdmaBlob) -> Vec<WriteStep> {
    let mut steps = Vec::new();
    let mut done = 0;
    while done < put.bytes {
        let bytes = (put.bytes - done).min(MAX_WRITE_BYTES);
        steps.push(WriteStep::Data {
            src_offset: put.src_offset + done,
            remote_addr: remote.data.addr + put.dst_offset + done,
            rkey: remote.data.rkey,
            bytes,
        });
        done += bytes;
    }
    if let Some((id, value)) = put.signal {
        steps.push(WriteStep::Flag { value, remote_addr: remote.signals.addr + 8 * id as u64, rkey: remote.signals.rkey });
    }
    steps
}

/// The page-aligned range covering `[base, base + bytes)`: (aligned base, length).
pub fn page_cover(base: u64, bytes: u64, page: u64) -> (u64, u64) {
    let start = base & !(page - 1);
    let end = (base + bytes).div_ceil(page) * page;
    (start, end - start)
}

/// Work requests one put can need: ⌈u32::MAX / MAX_WRITE_BYTES⌉ data writes and a flag
/// (ring commands carry u32 byte counts).
pub const MAX_WRITES_PER_COMMAND: u32 = 5;

/// Window sizes as peers see them, for range checks.
pub fn window_limits(blob: &RdmaBlob) -> (u64, u64) {
    (blob.data.bytes, blob.signals.bytes / 8)
}

/// Region sizes of a local window, checked for what RDMA registration needs.
pub fn check_window(window: &Window) -> Result<()> {
    if window.signals.base % 8 != 0 || window.signals.bytes % 8 != 0 {
        return Err(MkError::invalid_argument("signal words must be 8-byte aligned u64s"));
    }
    if window.data.bytes == 0 || window.signals.bytes == 0 {
        return Err(MkError::invalid_argument("an RDMA window needs a nonempty data and signal region"));
    }
    Ok(())
}

#[cfg(feature = "rdma")]
pub use verbs::{active_ports, usable_device_count, RdmaTransport};

#[cfg(feature = "rdma")]
mod verbs {
    use super::*;
    use crate::mk_info;
    use crate::transport::{check_peers, check_put_ranges, select_hcas, HcaFilter, MemoryKind, PostId, Transport};
    use rdma_sys::*;
    use std::ffi::CStr;
    use std::ptr::null_mut;

    const SEND_QUEUE_DEPTH: u32 = 64 * MAX_WRITES_PER_COMMAND;
    /// verbs.h's IBV_LINK_LAYER_ETHERNET (an anonymous enum rdma-sys does not bind): RoCE.
    const LINK_LAYER_ETHERNET: u8 = 2;
    const CQ_DEPTH: i32 = 4096;

    fn host_page_bytes() -> u64 {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 { p as u64 } else { 4096 }
    }

    fn errno_error(what: &str) -> MkError {
        MkError::system(format!("{what} failed: {}", std::io::Error::last_os_error()))
    }

    /// A device list from ibv_get_device_list, freed on drop.
    struct DeviceList {
        list: *mut *mut ibv_device,
        count: usize,
    }

    impl DeviceList {
        fn get() -> Option<DeviceList> {
            let mut n = 0;
            // SAFETY: writes the count; returns NULL (no devices / no driver) or a list we free.
            let list = unsafe { ibv_get_device_list(&mut n) };
            // Not `then_some`: that would build (and drop, freeing NULL) a list on failure.
            if list.is_null() {
                None
            } else {
                Some(DeviceList { list, count: n.max(0) as usize })
            }
        }

        fn devices(&self) -> impl Iterator<Item = *mut ibv_device> + '_ {
            // SAFETY: the list holds `count` valid device pointers.
            (0..self.count).map(move |i| unsafe { *self.list.add(i) })
        }
    }

    impl Drop for DeviceList {
        fn drop(&mut self) {
            // SAFETY: from ibv_get_device_list, freed once.
            unsafe { ibv_free_device_list(self.list) };
        }
    }

    fn device_name(dev: *mut ibv_device) -> String {
        // SAFETY: ibv_get_device_name returns a string owned by the device.
        unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }.to_string_lossy().into_owned()
    }

    fn query_port(ctx: *mut ibv_context, port: u8) -> Option<ibv_port_attr> {
        // SAFETY: ibv_port_attr is plain data; ___ibv_query_port fills it.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is an open device context.
        (unsafe { ___ibv_query_port(ctx, port, &mut attr) } == 0).then_some(attr)
    }

    /// Every (device, port) with an active port on this machine.
    pub fn active_ports() -> Vec<(String, u32)> {
        let Some(list) = DeviceList::get() else { return Vec::new() };
        let mut out = Vec::new();
        for dev in list.devices() {
            // SAFETY: dev comes from the live list; the context is closed below.
            let ctx = unsafe { ibv_open_device(dev) };
            if ctx.is_null() {
                continue;
            }
            // SAFETY: plain data filled by ibv_query_device.
            let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
            // SAFETY: ctx is open.
            if unsafe { ibv_query_device(ctx, &mut attr) } == 0 {
                for port in 1..=attr.phys_port_cnt {
                    if query_port(ctx, port).is_some_and(|p| p.state == ibv_port_state::IBV_PORT_ACTIVE) {
                        out.push((device_name(dev), port as u32));
                    }
                }
            }
            // SAFETY: opened above, closed once.
            unsafe { ibv_close_device(ctx) };
        }
        out
    }

    fn chosen_ports() -> Result<Vec<(String, u32)>> {
        let filter = crate::env::ib_hca().map(|s| HcaFilter::parse(&s)).transpose()?;
        Ok(select_hcas(filter.as_ref(), &active_ports()))
    }

    /// Devices `MK_IB_HCA` allows with an active port (0 without libibverbs devices).
    pub fn usable_device_count() -> usize {
        chosen_ports().map(|p| p.len()).unwrap_or(0)
    }

    /// The RDMA transport of one rank.
    pub struct RdmaTransport {
        rank: usize,
        nranks: usize,
        device: String,
        port: u8,
        ctx: *mut ibv_context,
        pd: *mut ibv_pd,
        cq: *mut ibv_cq,
        port_attr: ibv_port_attr,
        gid: [u8; 16],
        psn: u32,
        qps: Vec<*mut ibv_qp>,
        window: Option<Window>,
        data_mr: *mut ibv_mr,
        signals_mr: *mut ibv_mr,
        remotes: Vec<Option<RdmaBlob>>,
        /// Work requests outstanding per peer QP, to stay within its send queue.
        queued: Vec<u32>,
        /// (post id, peer, work requests) of every put not yet completed.
        outstanding: Vec<(PostId, usize, u32)>,
        next_post: PostId,
        failed: Option<MkError>,
    }

    // SAFETY: the verbs objects are used only from the thread that owns the transport
    // (the proxy's); ibverbs objects may move between threads.
    unsafe impl Send for RdmaTransport {}

    impl RdmaTransport {
        /// Opens the first (device, port) `MK_IB_HCA` allows.
        pub fn new(rank: usize, nranks: usize) -> Result<RdmaTransport> {
            let (name, port) = chosen_ports()?.into_iter().next().ok_or_else(|| {
                MkError::system("no RDMA device with an active port matches MK_IB_HCA (or none exists)")
            })?;
            if signal_ordering_for_device(&name) == SignalOrdering::WriteWithImm {
                return Err(MkError::invalid_usage(format!(
                    "{name} (EFA) needs WRITE_WITH_IMM signalling, which this build does not implement yet; set MK_NET=socket"
                )));
            }
            let list = DeviceList::get().ok_or_else(|| errno_error("ibv_get_device_list"))?;
            let dev = list.devices().find(|&d| device_name(d) == name).ok_or_else(|| MkError::system(format!("{name} vanished")))?;
            // SAFETY: dev is from the live list; the transport closes the context in Drop.
            let ctx = unsafe { ibv_open_device(dev) };
            if ctx.is_null() {
                return Err(errno_error(&format!("ibv_open_device({name})")));
            }
            let mut t = RdmaTransport {
                rank,
                nranks,
                device: name.clone(),
                port: port as u8,
                ctx,
                pd: null_mut(),
                cq: null_mut(),
                // SAFETY: plain data, filled below.
                port_attr: unsafe { std::mem::zeroed() },
                gid: [0; 16],
                psn: 0,
                qps: vec![null_mut(); nranks],
                window: None,
                data_mr: null_mut(),
                signals_mr: null_mut(),
                remotes: vec![None; nranks],
                queued: vec![0; nranks],
                outstanding: Vec::new(),
                next_post: 0,
                failed: None,
            };
            t.port_attr = query_port(ctx, t.port).ok_or_else(|| errno_error(&format!("ibv_query_port({name}:{port})")))?;
            // SAFETY: ibv_gid is plain data filled by ibv_query_gid (index 0: the port GID).
            let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
            // SAFETY: ctx is open, port exists.
            if unsafe { ibv_query_gid(ctx, t.port, 0, &mut gid) } != 0 {
                return Err(errno_error("ibv_query_gid"));
            }
            // SAFETY: every bit pattern of the union is a valid byte array.
            t.gid = unsafe { gid.raw };
            // SAFETY: ctx is open; the PD and CQ are released in Drop.
            t.pd = unsafe { ibv_alloc_pd(ctx) };
            if t.pd.is_null() {
                return Err(errno_error("ibv_alloc_pd"));
            }
            // SAFETY: as above.
            t.cq = unsafe { ibv_create_cq(ctx, CQ_DEPTH, null_mut(), null_mut(), 0) };
            if t.cq.is_null() {
                return Err(errno_error("ibv_create_cq"));
            }
            let mut psn = [0u8; 4];
            crate::bootstrap::net::random_bytes(&mut psn)?;
            t.psn = u32::from_le_bytes(psn) & 0xff_ffff;
            mk_info!(Some(rank), "RDMA transport on {name}:{port}");
            Ok(t)
        }

        fn register_region(&mut self, base: u64, bytes: u64, kind: MemoryKind) -> Result<*mut ibv_mr> {
            let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
                | ibv_access_flags::IBV_ACCESS_REMOTE_READ)
                .0 as i32;
            if kind == MemoryKind::Device {
                if let Some(mr) = self.register_dmabuf(base, bytes, access) {
                    return Ok(mr);
                }
            }
            // SAFETY: the caller of `register` keeps [base, base + bytes) valid until close;
            // for device memory this path needs nvidia_peermem.
            let mr = unsafe { ibv_reg_mr(self.pd, base as *mut _, bytes as usize, access) };
            if mr.is_null() {
                let hint = if kind == MemoryKind::Device { " (device memory: load nvidia_peermem or use a dmabuf-capable kernel)" } else { "" };
                return Err(MkError::system(format!(
                    "ibv_reg_mr of {bytes} bytes on {} failed: {}{hint}",
                    self.device,
                    std::io::Error::last_os_error()
                )));
            }
            Ok(mr)
        }

        /// dmabuf registration of device memory; None to fall back to ibv_reg_mr.
        fn register_dmabuf(&mut self, base: u64, bytes: u64, access: i32) -> Option<*mut ibv_mr> {
            use cudarc::driver::sys;
            crate::cuda::driver().ok()?;
            // The driver exports whole pages: export the page-aligned cover of the range
            // and register the range at its offset inside it.
            let (export_base, export_bytes) = page_cover(base, bytes, host_page_bytes());
            let mut fd: i32 = -1;
            // SAFETY: writes a new dmabuf fd for the device range into `fd`.
            let r = unsafe {
                sys::cuMemGetHandleForAddressRange(
                    (&mut fd as *mut i32).cast(),
                    export_base,
                    export_bytes as usize,
                    sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                    0,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS || fd < 0 {
                return None;
            }
            // SAFETY: fd names the dmabuf of [export_base, +export_bytes), which covers
            // [base, +bytes) at offset base - export_base; iova = base keeps remote
            // addresses equal to device pointers.
            let mr = unsafe { ibv_reg_dmabuf_mr(self.pd, base - export_base, bytes as usize, base, fd, access) };
            // SAFETY: the MR holds its own reference to the dmabuf; our fd is ours to close.
            unsafe { libc::close(fd) };
            (!mr.is_null()).then_some(mr)
        }

        fn modify_qp(&self, qp: *mut ibv_qp, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, what: &str) -> Result<()> {
            // SAFETY: qp is live; attr is filled for the fields in mask.
            let r = unsafe { ibv_modify_qp(qp, attr, mask.0 as i32) };
            if r != 0 {
                return Err(MkError::system(format!("ibv_modify_qp to {what} failed: {}", std::io::Error::from_raw_os_error(r))));
            }
            Ok(())
        }

        fn create_qp(&mut self, peer: usize) -> Result<()> {
            // SAFETY: plain data.
            let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
            init.send_cq = self.cq;
            init.recv_cq = self.cq;
            init.qp_type = ibv_qp_type::IBV_QPT_RC;
            init.sq_sig_all = 0;
            init.cap.max_send_wr = SEND_QUEUE_DEPTH;
            init.cap.max_recv_wr = 1;
            init.cap.max_send_sge = 1;
            init.cap.max_recv_sge = 1;
            init.cap.max_inline_data = 8;
            // SAFETY: pd is live; the QP is destroyed in Drop.
            let qp = unsafe { ibv_create_qp(self.pd, &mut init) };
            if qp.is_null() {
                return Err(errno_error(&format!("ibv_create_qp for rank {peer}")));
            }
            self.qps[peer] = qp;
            // SAFETY: plain data.
            let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
            attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
            attr.port_num = self.port;
            attr.pkey_index = 0;
            attr.qp_access_flags = (ibv_access_flags::IBV_ACCESS_REMOTE_WRITE | ibv_access_flags::IBV_ACCESS_LOCAL_WRITE).0;
            let mask = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
            self.modify_qp(qp, &mut attr, mask, "INIT")
        }

        fn connect_qp(&self, peer: usize, remote: &RdmaBlob) -> Result<()> {
            let qp = self.qps[peer];
            if remote.qp_nums.len() != self.nranks {
                return Err(MkError::remote(format!(
                    "rank {peer}'s RDMA connection data names {} ranks, this communicator has {}",
                    remote.qp_nums.len(),
                    self.nranks
                )));
            }
            let remote_qpn = *remote.qp_nums.get(self.rank).filter(|&&q| q != 0).ok_or_else(|| {
                MkError::invalid_usage(format!("rank {peer} has no queue pair for rank {}: every peer must list the other", self.rank))
            })?;
            // SAFETY: plain data.
            let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
            attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
            attr.path_mtu = remote.mtu.min(self.port_attr.active_mtu);
            attr.dest_qp_num = remote_qpn;
            attr.rq_psn = remote.psn;
            attr.max_dest_rd_atomic = 1;
            attr.min_rnr_timer = 12;
            attr.ah_attr.dlid = remote.lid;
            attr.ah_attr.port_num = self.port;
            // RoCE has no LIDs: route by GID.
            if remote.lid == 0 || self.port_attr.link_layer == LINK_LAYER_ETHERNET {
                attr.ah_attr.is_global = 1;
                attr.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
                attr.ah_attr.grh.hop_limit = 64;
                attr.ah_attr.grh.sgid_index = 0;
            }
            let mask = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
            self.modify_qp(qp, &mut attr, mask, "RTR")?;
            // SAFETY: plain data.
            let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
            attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
            attr.sq_psn = self.psn;
            // 4.096 µs × 2^14 ≈ 67 ms per try, 7 retries: a dead peer fails a put in about
            // half a second (IBV_WC_RETRY_EXC_ERR → mkRemoteError), well inside MK_TIMEOUT_MS.
            attr.timeout = 14;
            attr.retry_cnt = 7;
            attr.rnr_retry = 7;
            attr.max_rd_atomic = 1;
            let mask = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
            self.modify_qp(qp, &mut attr, mask, "RTS")
        }

        fn post(&mut self, peer: usize, steps: &[WriteStep], post_id: PostId) -> Result<()> {
            let window = self.window.expect("checked by post_put");
            // SAFETY: data_mr is registered (post_put checks `window`).
            let lkey = unsafe { (*self.data_mr).lkey };
            let mut sges: Vec<ibv_sge> = Vec::with_capacity(steps.len());
            // Full capacity up front: SGEs point into this vector, which must not reallocate.
            let mut flag_values: Vec<u64> = Vec::with_capacity(steps.len());
            // SAFETY: plain data; every field used is set below.
            let mut wrs: Vec<ibv_send_wr> = (0..steps.len()).map(|_| unsafe { std::mem::zeroed() }).collect();
            for step in steps {
                match *step {
                    WriteStep::Data { src_offset, bytes, .. } => {
                        sges.push(ibv_sge { addr: window.data.base + src_offset, length: bytes as u32, lkey });
                    }
                    WriteStep::Flag { value, .. } => {
                        flag_values.push(value);
                        // Inline: the value is copied at post time, so a pointer into this
                        // vector (not moved before ibv_post_send) is enough.
                        let addr = flag_values.last().expect("just pushed") as *const u64 as u64;
                        sges.push(ibv_sge { addr, length: 8, lkey: 0 });
                    }
                }
            }
            let n = steps.len();
            for (i, step) in steps.iter().enumerate() {
                let wr = &mut wrs[i];
                wr.wr_id = post_id;
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                wr.num_sge = 1;
                wr.sg_list = &mut sges[i];
                let (remote_addr, rkey, inline) = match *step {
                    WriteStep::Data { remote_addr, rkey, .. } => (remote_addr, rkey, false),
                    WriteStep::Flag { remote_addr, rkey, .. } => (remote_addr, rkey, true),
                };
                wr.wr.rdma = rdma_t { remote_addr, rkey };
                let mut flags = 0;
                if inline {
                    flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                }
                if i + 1 == n {
                    flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                wr.send_flags = flags;
            }
            for i in 0..n.saturating_sub(1) {
                let next: *mut ibv_send_wr = &mut wrs[i + 1];
                wrs[i].next = next;
            }
            let mut bad: *mut ibv_send_wr = null_mut();
            // SAFETY: the chain, its SGEs and the inline values live until the call returns;
            // the data SGEs point into the registered window.
            let r = unsafe { ibv_post_send(self.qps[peer], wrs.as_mut_ptr(), &mut bad) };
            if r != 0 {
                return Err(MkError::system(format!(
                    "ibv_post_send to rank {peer} failed: {}",
                    std::io::Error::from_raw_os_error(r)
                )));
            }
            Ok(())
        }
    }

    impl Transport for RdmaTransport {
        fn name(&self) -> &'static str {
            "ib"
        }

        unsafe fn register(&mut self, window: Window) -> Result<()> {
            if self.window.is_some() {
                return Err(MkError::invalid_usage("the RDMA transport's window is already registered"));
            }
            check_window(&window)?;
            self.data_mr = self.register_region(window.data.base, window.data.bytes, window.data.kind)?;
            self.signals_mr = self.register_region(window.signals.base, window.signals.bytes, window.signals.kind)?;
            self.window = Some(window);
            Ok(())
        }

        fn connection_blob(&mut self, peers: &[usize]) -> Result<Vec<u8>> {
            let window = self.window.ok_or_else(|| MkError::invalid_usage("register a window before connecting"))?;
            check_peers(self.rank, self.nranks, self.nranks, peers)?;
            for &p in peers {
                if self.qps[p].is_null() {
                    self.create_qp(p)?;
                }
            }
            // SAFETY: both MRs are registered once the window is.
            let (data_rkey, signals_rkey) = unsafe { ((*self.data_mr).rkey, (*self.signals_mr).rkey) };
            let qp_nums = self
                .qps
                .iter()
                // SAFETY: non-null entries are live QPs.
                .map(|&qp| if qp.is_null() { 0 } else { unsafe { (*qp).qp_num } })
                .collect();
            Ok(RdmaBlob {
                lid: self.port_attr.lid,
                gid: self.gid,
                mtu: self.port_attr.active_mtu,
                psn: self.psn,
                data: RemoteRegion { addr: window.data.base, rkey: data_rkey, bytes: window.data.bytes },
                signals: RemoteRegion { addr: window.signals.base, rkey: signals_rkey, bytes: window.signals.bytes },
                qp_nums,
            }
            .encode())
        }

        fn connect(&mut self, blobs: &[Vec<u8>], peers: &[usize]) -> Result<()> {
            check_peers(self.rank, self.nranks, blobs.len(), peers)?;
            for &p in peers {
                let remote = RdmaBlob::decode(&blobs[p], p)?;
                self.connect_qp(p, &remote)?;
                self.remotes[p] = Some(remote);
            }
            Ok(())
        }

        fn post_put(&mut self, put: &PutRequest) -> Result<PostId> {
            if let Some(e) = &self.failed {
                return Err(e.clone());
            }
            let window = self.window.ok_or_else(|| MkError::invalid_usage("register a window before posting"))?;
            let remote = self
                .remotes
                .get(put.peer)
                .and_then(|r| r.as_ref())
                .ok_or_else(|| MkError::invalid_argument(format!("rank {} is not connected to rank {}", self.rank, put.peer)))?;
            let (data_bytes, signal_words) = window_limits(remote);
            check_put_ranges(put, &window, data_bytes, signal_words)?;
            let steps = plan_put(put, remote);
            let id = self.next_post;
            self.next_post += 1;
            if steps.is_empty() {
                self.outstanding.push((id, put.peer, 0));
                return Ok(id);
            }
            let wrs = steps.len() as u32;
            if self.queued[put.peer] + wrs > SEND_QUEUE_DEPTH {
                return Err(MkError::internal(format!(
                    "send queue to rank {} is full ({SEND_QUEUE_DEPTH} work requests): more puts in flight than the proxy allows",
                    put.peer
                )));
            }
            self.post(put.peer, &steps, id)?;
            self.queued[put.peer] += wrs;
            self.outstanding.push((id, put.peer, wrs));
            Ok(id)
        }

        fn poll(&mut self, completed: &mut Vec<PostId>) -> Result<()> {
            // Puts that needed no work request complete at once.
            self.outstanding.retain(|&(id, _, wrs)| {
                if wrs == 0 {
                    completed.push(id);
                }
                wrs != 0
            });
            if let Some(e) = &self.failed {
                return Err(e.clone());
            }
            // SAFETY: plain data filled by ibv_poll_cq.
            let mut wcs: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
            loop {
                // SAFETY: cq is live; wcs has room for 16 entries.
                let n = unsafe { ibv_poll_cq(self.cq, wcs.len() as i32, wcs.as_mut_ptr()) };
                if n < 0 {
                    let e = MkError::system(format!("ibv_poll_cq failed ({n})"));
                    self.failed = Some(e.clone());
                    return Err(e);
                }
                for wc in &wcs[..n as usize] {
                    let Some(pos) = self.outstanding.iter().position(|&(id, _, _)| id == wc.wr_id) else { continue };
                    let (id, peer, wrs) = self.outstanding.remove(pos);
                    self.queued[peer] -= wrs;
                    if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
                        // SAFETY: returns a static string.
                        let why = unsafe { CStr::from_ptr(ibv_wc_status_str(wc.status)) }.to_string_lossy();
                        let e = MkError::remote(format!("RDMA write to rank {peer} failed: {why} (is rank {peer} alive?)"));
                        self.failed = Some(e.clone());
                        return Err(e);
                    }
                    completed.push(id);
                }
                if (n as usize) < wcs.len() {
                    return Ok(());
                }
            }
        }

        fn close(&mut self) -> Result<()> {
            // Release order: QPs, MRs, CQ, PD, context (Drop does the same, idempotently).
            self.release();
            Ok(())
        }
    }

    impl RdmaTransport {
        fn release(&mut self) {
            for qp in &mut self.qps {
                if !qp.is_null() {
                    // SAFETY: created by ibv_create_qp, destroyed once.
                    unsafe { ibv_destroy_qp(*qp) };
                    *qp = null_mut();
                }
            }
            for mr in [&mut self.data_mr, &mut self.signals_mr] {
                if !mr.is_null() {
                    // SAFETY: registered by us, deregistered once.
                    unsafe { ibv_dereg_mr(*mr) };
                    *mr = null_mut();
                }
            }
            if !self.cq.is_null() {
                // SAFETY: created by us; its QPs are gone.
                unsafe { ibv_destroy_cq(self.cq) };
                self.cq = null_mut();
            }
            if !self.pd.is_null() {
                // SAFETY: allocated by us; its QPs and MRs are gone.
                unsafe { ibv_dealloc_pd(self.pd) };
                self.pd = null_mut();
            }
            if !self.ctx.is_null() {
                // SAFETY: opened by us, closed once, after everything made from it.
                unsafe { ibv_close_device(self.ctx) };
                self.ctx = null_mut();
            }
        }
    }

    impl Drop for RdmaTransport {
        fn drop(&mut self) {
            self.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;
    use crate::transport::{MemoryKind, MemoryRegion};

    fn blob() -> RdmaBlob {
        RdmaBlob {
            lid: 0x1234,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            mtu: 5,
            psn: 0xabcdef,
            data: RemoteRegion { addr: 0x7f00_0000_0000, rkey: 0x1111, bytes: 1 << 32 },
            signals: RemoteRegion { addr: 0x7f10_0000_0000, rkey: 0x2222, bytes: 8 * 64 },
            qp_nums: vec![0, 0x77, 0, 0x99],
        }
    }

    #[test]
    fn connection_data_round_trips_and_rejects_garbage() {
        let b = blob();
        let bytes = b.encode();
        assert_eq!(RdmaBlob::decode(&bytes, 2).unwrap(), b);
        for cut in [0, 3, 4, 20, bytes.len() - 1] {
            assert_eq!(RdmaBlob::decode(&bytes[..cut], 2).unwrap_err().code, mkResult_t::mkRemoteError, "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(RdmaBlob::decode(&longer, 2).is_err());
        let mut socket_blob = bytes.clone();
        socket_blob[..4].copy_from_slice(b"MKS1");
        let e = RdmaBlob::decode(&socket_blob, 2).unwrap_err();
        assert!(e.message.contains("MK_NET"), "a socket rank meeting an ib rank is told why: {e}");
    }

    #[test]
    fn put_becomes_data_writes_then_flag() {
        let remote = blob();
        let put = PutRequest { peer: 1, src_offset: 100, dst_offset: 4096, bytes: 5000, signal: Some((3, 42)) };
        assert_eq!(
            plan_put(&put, &remote),
            vec![
                WriteStep::Data { src_offset: 100, remote_addr: remote.data.addr + 4096, rkey: 0x1111, bytes: 5000 },
                WriteStep::Flag { value: 42, remote_addr: remote.signals.addr + 24, rkey: 0x2222 },
            ]
        );
        let signal_only = PutRequest { bytes: 0, ..put };
        assert!(matches!(plan_put(&signal_only, &remote)[..], [WriteStep::Flag { value: 42, .. }]));
        let quiet = PutRequest { signal: None, ..put };
        assert!(matches!(plan_put(&quiet, &remote)[..], [WriteStep::Data { .. }]));
        assert!(plan_put(&PutRequest { bytes: 0, signal: None, ..put }, &remote).is_empty());
    }

    #[test]
    fn large_puts_are_split_and_fit_the_send_queue_budget() {
        let remote = blob();
        let put = PutRequest { peer: 1, src_offset: 0, dst_offset: 8, bytes: u32::MAX as u64, signal: Some((0, 1)) };
        let steps = plan_put(&put, &remote);
        assert_eq!(steps.len() as u32, MAX_WRITES_PER_COMMAND);
        let mut next_src = 0;
        for s in &steps[..steps.len() - 1] {
            let WriteStep::Data { src_offset, remote_addr, bytes, .. } = *s else { panic!("data first") };
            assert_eq!(src_offset, next_src);
            assert_eq!(remote_addr, remote.data.addr + 8 + src_offset);
            assert!(bytes <= MAX_WRITE_BYTES);
            next_src += bytes;
        }
        assert_eq!(next_src, u32::MAX as u64);
        assert!(matches!(steps.last(), Some(WriteStep::Flag { .. })));
    }

    #[test]
    fn dmabuf_export_covers_whole_pages() {
        assert_eq!(page_cover(0x10000, 0x1000, 0x1000), (0x10000, 0x1000));
        assert_eq!(page_cover(0x10010, 0x10, 0x1000), (0x10000, 0x1000));
        assert_eq!(page_cover(0x10ff0, 0x20, 0x1000), (0x10000, 0x2000));
        let (b, n) = page_cover(0x7f00_1234_5678, 3 << 20, 1 << 16);
        assert!(b <= 0x7f00_1234_5678 && b + n >= 0x7f00_1234_5678 + (3 << 20) && b % (1 << 16) == 0 && n % (1 << 16) == 0);
    }

    #[test]
    fn efa_needs_write_with_immediate() {
        assert_eq!(signal_ordering_for_device("efa_0"), SignalOrdering::WriteWithImm);
        assert_eq!(signal_ordering_for_device("mlx5_3"), SignalOrdering::WriteThenFlag);
        assert_eq!(signal_ordering_for_device("rxe0"), SignalOrdering::WriteThenFlag);
    }

    /// The no-device fallback, with the verbs code built: on a machine without RDMA devices
    /// (CI, the development machine, the GPU machine) sockets are chosen and asking for the
    /// RDMA transport is a clear error, not a crash. On a machine with a device it checks
    /// the opposite choice.
    #[cfg(feature = "rdma")]
    #[test]
    fn without_devices_sockets_are_chosen() {
        use crate::transport::{select_net, NetKind};
        let ports = active_ports();
        let usable = usable_device_count();
        if ports.is_empty() {
            assert_eq!(usable, 0);
            assert_eq!(select_net(None, true, usable).unwrap(), NetKind::Socket);
            let e = RdmaTransport::new(0, 2).err().expect("no device to open");
            assert_eq!(e.code, mkResult_t::mkSystemError, "{e}");
            assert_eq!(select_net(Some("ib"), true, usable).unwrap_err().code, mkResult_t::mkSystemError);
        } else {
            assert_eq!(select_net(None, true, ports.len()).unwrap(), NetKind::Ib);
        }
    }

    #[test]
    fn windows_are_checked() {
        let r = |base, bytes| MemoryRegion { base, bytes, kind: MemoryKind::Device };
        assert!(check_window(&Window { data: r(0x1000, 10), signals: r(0x2000, 16) }).is_ok());
        assert!(check_window(&Window { data: r(0x1000, 10), signals: r(0x2004, 16) }).is_err());
        assert!(check_window(&Window { data: r(0x1000, 0), signals: r(0x2000, 16) }).is_err());
        assert!(check_window(&Window { data: r(0x1000, 10), signals: r(0x2000, 12) }).is_err());
    }
}
