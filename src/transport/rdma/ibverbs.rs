//! The real verbs layer: libibverbs.so.1 (and libefa.so.1 on EFA) opened with dlopen the
//! first time RDMA is considered, never linked, so libmkernel loads and runs over sockets
//! where they are missing. Exported verbs functions are looked up with dlsym; the inline
//! ones (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_wr_*) are called through the
//! provider's function pointers, as verbs.h does (`abi`).
//!
//! RC (InfiniBand, RoCE): one RC queue pair per peer, legacy ibv_post_send. EFA (`efa`):
//! one SRD queue pair per peer from efadv_create_qp_ex, work requests built with the
//! ibv_wr_* interface, an address handle per peer. Device memory is registered by dmabuf
//! (cuMemGetHandleForAddressRange → ibv_reg_dmabuf_mr), falling back to ibv_reg_mr (which
//! needs nvidia_peermem) on RC devices.

use super::abi::*;
use super::efa;
use super::verbs::{
    Completion, CompletionKind, MemoryKeys, PortAddress, PostError, SignalOrdering, Verbs, WorkOp, WorkRequest,
    SIGNAL_MESSAGE_BYTES,
};
use super::{page_cover, RdmaBlob, MAX_WRITES_PER_COMMAND};
use crate::error::{MkError, Result};
use crate::mk_info;
use crate::transport::{select_hcas, HcaFilter, MemoryKind, MemoryRegion};
use libloading::Library;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::null_mut;
use std::sync::OnceLock;

type Ptr = *mut c_void;

/// Send work requests requested per queue pair (the device may grant fewer).
const SEND_QUEUE_DEPTH: u32 = 64 * MAX_WRITES_PER_COMMAND;
/// Receives per SRD queue pair.
const RECEIVE_QUEUE_DEPTH: u32 = 256;
const CQ_DEPTH: c_int = 8192;
/// Bytes an RC queue pair must take inline (the 8-byte signal value).
const MAX_INLINE: u32 = 16;
/// Tags receive work request ids (send ids are post ids, far below).
const RECEIVE_TAG: u64 = 1 << 63;

/// The dlsym'd verbs entry points (and libefa's, where it exists).
pub struct VerbsLibrary {
    _ibverbs: Library,
    _efa: Option<Library>,
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut Ptr,
    pub free_device_list: unsafe extern "C" fn(*mut Ptr),
    pub get_device_name: unsafe extern "C" fn(Ptr) -> *const c_char,
    pub open_device: unsafe extern "C" fn(Ptr) -> Ptr,
    pub close_device: unsafe extern "C" fn(Ptr) -> c_int,
    pub query_device: unsafe extern "C" fn(Ptr, *mut u8) -> c_int,
    pub query_port: unsafe extern "C" fn(Ptr, u8, *mut u8) -> c_int,
    pub query_gid: unsafe extern "C" fn(Ptr, u8, c_int, *mut [u8; 16]) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(Ptr) -> Ptr,
    pub dealloc_pd: unsafe extern "C" fn(Ptr) -> c_int,
    pub reg_mr: unsafe extern "C" fn(Ptr, Ptr, usize, c_int) -> Ptr,
    /// Exported since rdma-core 34 (IBVERBS_1.12); None before.
    pub reg_dmabuf_mr: Option<unsafe extern "C" fn(Ptr, u64, usize, u64, c_int, c_int) -> Ptr>,
    pub dereg_mr: unsafe extern "C" fn(Ptr) -> c_int,
    pub create_cq: unsafe extern "C" fn(Ptr, c_int, Ptr, Ptr, c_int) -> Ptr,
    pub destroy_cq: unsafe extern "C" fn(Ptr) -> c_int,
    pub create_qp: unsafe extern "C" fn(Ptr, *mut ibv_qp_init_attr) -> Ptr,
    pub destroy_qp: unsafe extern "C" fn(Ptr) -> c_int,
    pub modify_qp: unsafe extern "C" fn(Ptr, *mut ibv_qp_attr, c_int) -> c_int,
    pub create_ah: unsafe extern "C" fn(Ptr, *mut ibv_ah_attr) -> Ptr,
    pub destroy_ah: unsafe extern "C" fn(Ptr) -> c_int,
    pub wc_status_str: unsafe extern "C" fn(u32) -> *const c_char,
    pub qp_to_qp_ex: unsafe extern "C" fn(Ptr) -> Ptr,
    pub efa: Option<efa::EfaFunctions>,
}

impl VerbsLibrary {
    fn load() -> std::result::Result<VerbsLibrary, String> {
        // SAFETY: loading libibverbs runs its constructors, which only set up its provider
        // list; nothing else in the process depends on it.
        let lib = unsafe { Library::new("libibverbs.so.1") }.map_err(|e| format!("libibverbs.so.1: {e}"))?;
        macro_rules! sym {
            ($lib:expr, $name:literal) => {
                // SAFETY: the field's type is the C prototype of the symbol (verbs.h); the
                // library stays loaded as long as the table (which is never dropped).
                *unsafe { $lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| format!("{}: {e}", $name))?
            };
        }
        // SAFETY: as above; a missing symbol is a None.
        let reg_dmabuf_mr = unsafe { lib.get(b"ibv_reg_dmabuf_mr\0") }.ok().map(|s| *s);
        let efa = efa::EfaFunctions::load();
        Ok(VerbsLibrary {
            get_device_list: sym!(lib, "ibv_get_device_list"),
            free_device_list: sym!(lib, "ibv_free_device_list"),
            get_device_name: sym!(lib, "ibv_get_device_name"),
            open_device: sym!(lib, "ibv_open_device"),
            close_device: sym!(lib, "ibv_close_device"),
            query_device: sym!(lib, "ibv_query_device"),
            query_port: sym!(lib, "ibv_query_port"),
            query_gid: sym!(lib, "ibv_query_gid"),
            alloc_pd: sym!(lib, "ibv_alloc_pd"),
            dealloc_pd: sym!(lib, "ibv_dealloc_pd"),
            reg_mr: sym!(lib, "ibv_reg_mr"),
            reg_dmabuf_mr,
            dereg_mr: sym!(lib, "ibv_dereg_mr"),
            create_cq: sym!(lib, "ibv_create_cq"),
            destroy_cq: sym!(lib, "ibv_destroy_cq"),
            create_qp: sym!(lib, "ibv_create_qp"),
            destroy_qp: sym!(lib, "ibv_destroy_qp"),
            modify_qp: sym!(lib, "ibv_modify_qp"),
            create_ah: sym!(lib, "ibv_create_ah"),
            destroy_ah: sym!(lib, "ibv_destroy_ah"),
            wc_status_str: sym!(lib, "ibv_wc_status_str"),
            qp_to_qp_ex: sym!(lib, "ibv_qp_to_qp_ex"),
            efa: efa.as_ref().map(|(f, _)| *f),
            _efa: efa.map(|(_, l)| l),
            _ibverbs: lib,
        })
    }
}

/// The verbs library, loaded once; Err(why) where it cannot be.
pub fn library() -> std::result::Result<&'static VerbsLibrary, &'static str> {
    static LIBRARY: OnceLock<std::result::Result<VerbsLibrary, String>> = OnceLock::new();
    LIBRARY.get_or_init(VerbsLibrary::load).as_ref().map_err(String::as_str)
}

/// Reads a `T` at `offset` bytes into the object at `base`.
///
/// # Safety
/// `base + offset` must hold an initialised `T`.
unsafe fn read_at<T: Copy>(base: *const c_void, offset: usize) -> T {
    // SAFETY: forwarded.
    unsafe { std::ptr::read_unaligned(base.cast::<u8>().add(offset).cast::<T>()) }
}

fn errno_error(what: &str) -> MkError {
    MkError::system(format!("{what} failed: {}", std::io::Error::last_os_error()))
}

/// A device list, freed on drop.
struct DeviceList {
    lib: &'static VerbsLibrary,
    list: *mut Ptr,
    count: usize,
}

impl DeviceList {
    fn get(lib: &'static VerbsLibrary) -> Option<DeviceList> {
        let mut n = 0;
        // SAFETY: writes the count; returns NULL or a list freed in Drop.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        (!list.is_null()).then(|| DeviceList { lib, list, count: n.max(0) as usize })
    }

    fn devices(&self) -> impl Iterator<Item = Ptr> + '_ {
        // SAFETY: the list holds `count` device pointers.
        (0..self.count).map(move |i| unsafe { *self.list.add(i) })
    }

    fn name(&self, dev: Ptr) -> String {
        // SAFETY: the name is a string owned by the device.
        unsafe { CStr::from_ptr((self.lib.get_device_name)(dev)) }.to_string_lossy().into_owned()
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: from ibv_get_device_list, freed once.
        unsafe { (self.lib.free_device_list)(self.list) };
    }
}

/// The port attributes the layer uses.
#[derive(Clone, Copy, Debug)]
struct PortInfo {
    state: u32,
    active_mtu: u32,
    lid: u16,
    link_layer: u8,
}

fn query_port(lib: &VerbsLibrary, ctx: Ptr, port: u8) -> Option<PortInfo> {
    let mut attr = [0u64; PORT_ATTR_ROOM / 8];
    // SAFETY: the buffer is larger than any version's ibv_port_attr.
    if unsafe { (lib.query_port)(ctx, port, attr.as_mut_ptr().cast()) } != 0 {
        return None;
    }
    let p = attr.as_ptr().cast::<c_void>();
    // SAFETY: offsets inside the filled prefix (abi).
    unsafe {
        Some(PortInfo {
            state: read_at(p, PORT_STATE),
            active_mtu: read_at(p, PORT_ACTIVE_MTU),
            lid: read_at(p, PORT_LID),
            link_layer: read_at(p, PORT_LINK_LAYER),
        })
    }
}

/// (phys_port_cnt, max_qp_wr) of an open device.
fn query_device(lib: &VerbsLibrary, ctx: Ptr) -> Option<(u8, u32)> {
    let mut attr = [0u64; DEVICE_ATTR_ROOM / 8];
    // SAFETY: the buffer is larger than ibv_device_attr.
    if unsafe { (lib.query_device)(ctx, attr.as_mut_ptr().cast()) } != 0 {
        return None;
    }
    let p = attr.as_ptr().cast::<c_void>();
    // SAFETY: offsets inside ibv_device_attr (abi).
    unsafe { Some((read_at(p, DEVICE_PHYS_PORT_CNT), read_at::<i32>(p, DEVICE_MAX_QP_WR).max(0) as u32)) }
}

/// Every (device, port) with an active port; empty without libibverbs or devices.
pub fn active_ports() -> Vec<(String, u32)> {
    let Ok(lib) = library() else { return Vec::new() };
    let Some(list) = DeviceList::get(lib) else { return Vec::new() };
    let mut out = Vec::new();
    for dev in list.devices() {
        // SAFETY: dev is from the live list; closed below.
        let ctx = unsafe { (lib.open_device)(dev) };
        if ctx.is_null() {
            continue;
        }
        if let Some((ports, _)) = query_device(lib, ctx) {
            for port in 1..=ports {
                if query_port(lib, ctx, port).is_some_and(|p| p.state == IBV_PORT_ACTIVE) {
                    out.push((list.name(dev), port as u32));
                }
            }
        }
        // SAFETY: opened above, closed once.
        unsafe { (lib.close_device)(ctx) };
    }
    out
}

fn chosen_ports() -> Result<Vec<(String, u32)>> {
    let filter = crate::env::ib_hca().map(|s| HcaFilter::parse(&s)).transpose()?;
    Ok(select_hcas(filter.as_ref(), &active_ports()))
}

/// Devices `MK_IB_HCA` allows with an active port (0 without libibverbs or devices).
pub fn usable_device_count() -> usize {
    chosen_ports().map(|p| p.len()).unwrap_or(0)
}

/// Receive buffers of one SRD queue pair: one `SIGNAL_MESSAGE_BYTES` slot per receive.
struct ReceiveSlots {
    buffer: Box<[[u8; SIGNAL_MESSAGE_BYTES]]>,
    mr: Ptr,
    free: Vec<u32>,
}

struct QueuePair {
    qp: Ptr,
    /// The ibv_qp_ex view (SRD).
    qpx: Ptr,
    /// Address handle of the peer (SRD).
    ah: Ptr,
    remote_qp: u32,
    receives: Option<ReceiveSlots>,
}

/// One rank's RDMA device through libibverbs.
pub struct IbVerbs {
    lib: &'static VerbsLibrary,
    device: String,
    port: u8,
    ordering: SignalOrdering,
    ctx: Ptr,
    pd: Ptr,
    cq: Ptr,
    port_info: PortInfo,
    gid: [u8; 16],
    psn: u32,
    send_depth: u32,
    receive_depth: u32,
    max_qp_wr: u32,
    efa_caps: u32,
    max_write: u64,
    queue_pairs: HashMap<usize, QueuePair>,
    peer_of_qp: HashMap<u32, usize>,
    mrs: Vec<Ptr>,
    wcs: Vec<ibv_wc>,
}

// SAFETY: the verbs objects are used from the one thread that owns the transport (the
// proxy's); ibverbs objects may move between threads.
unsafe impl Send for IbVerbs {}

impl IbVerbs {
    /// Opens the first (device, port) `MK_IB_HCA` allows.
    pub fn open(rank: usize) -> Result<IbVerbs> {
        let lib =
            library().map_err(|why| MkError::system(format!("RDMA needs libibverbs, which did not load ({why})")))?;
        let (name, port) = chosen_ports()?
            .into_iter()
            .next()
            .ok_or_else(|| MkError::system("no RDMA device with an active port matches MK_IB_HCA (or none exists)"))?;
        let list = DeviceList::get(lib).ok_or_else(|| errno_error("ibv_get_device_list"))?;
        let dev = list
            .devices()
            .find(|&d| list.name(d) == name)
            .ok_or_else(|| MkError::system(format!("{name} vanished")))?;
        // SAFETY: dev is from the live list; the context is closed in Drop.
        let ctx = unsafe { (lib.open_device)(dev) };
        if ctx.is_null() {
            return Err(errno_error(&format!("ibv_open_device({name})")));
        }
        let mut v = IbVerbs {
            lib,
            device: name.clone(),
            port: port as u8,
            ordering: SignalOrdering::WriteThenFlag,
            ctx,
            pd: null_mut(),
            cq: null_mut(),
            port_info: PortInfo { state: 0, active_mtu: 0, lid: 0, link_layer: 0 },
            gid: [0; 16],
            psn: 0,
            send_depth: SEND_QUEUE_DEPTH,
            receive_depth: 0,
            max_qp_wr: SEND_QUEUE_DEPTH,
            efa_caps: 0,
            max_write: super::MAX_WRITE_BYTES,
            queue_pairs: HashMap::new(),
            peer_of_qp: HashMap::new(),
            mrs: Vec::new(),
            wcs: vec![ibv_wc::default(); 32],
        };
        v.port_info =
            query_port(lib, ctx, v.port).ok_or_else(|| errno_error(&format!("ibv_query_port({name}:{port})")))?;
        if let Some((_, max_qp_wr)) = query_device(lib, ctx) {
            v.max_qp_wr = max_qp_wr.max(1);
        }
        if let Some(efa_device) = efa::query_device(lib, ctx) {
            if efa_device.caps & EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE == 0 {
                return Err(MkError::system(format!(
                    "{name} (EFA) does not offer RDMA write (it needs a second-generation EFA device and rdma-core 45 or \
                     later); set MK_NET=socket"
                )));
            }
            v.ordering = SignalOrdering::Sequenced;
            v.efa_caps = efa_device.caps;
            if efa_device.max_rdma_size > 0 {
                v.max_write = v.max_write.min(efa_device.max_rdma_size as u64);
            }
            v.send_depth = SEND_QUEUE_DEPTH.min(efa_device.max_sq_wr.max(1));
            v.receive_depth = RECEIVE_QUEUE_DEPTH.min(efa_device.max_rq_wr.max(1));
        } else if name.starts_with("efa") {
            return Err(MkError::system(format!("{name} looks like an EFA device, but libefa.so.1 did not load")));
        } else {
            v.send_depth = SEND_QUEUE_DEPTH.min(v.max_qp_wr);
        }
        // SAFETY: ctx is open; the GID is 16 bytes.
        if unsafe { (lib.query_gid)(ctx, v.port, 0, &mut v.gid) } != 0 {
            return Err(errno_error("ibv_query_gid"));
        }
        // SAFETY: ctx is open; released in Drop.
        v.pd = unsafe { (lib.alloc_pd)(ctx) };
        if v.pd.is_null() {
            return Err(errno_error("ibv_alloc_pd"));
        }
        // SAFETY: as above.
        v.cq = unsafe { (lib.create_cq)(ctx, CQ_DEPTH, null_mut(), null_mut(), 0) };
        if v.cq.is_null() {
            return Err(errno_error("ibv_create_cq"));
        }
        let mut psn = [0u8; 4];
        crate::bootstrap::net::random_bytes(&mut psn)?;
        v.psn = u32::from_le_bytes(psn) & 0xff_ffff;
        mk_info!(Some(rank), "RDMA transport on {name}:{port} ({:?}, send queue {})", v.ordering, v.send_depth);
        Ok(v)
    }

    fn register_pointer(&mut self, base: u64, bytes: u64, kind: MemoryKind) -> Result<Ptr> {
        let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
        if kind == MemoryKind::Device {
            if let Some(mr) = self.register_dmabuf(base, bytes, access) {
                return Ok(mr);
            }
            if self.ordering == SignalOrdering::Sequenced {
                return Err(MkError::system(format!(
                    "{}: registering device memory by dmabuf failed (EFA needs dmabuf: Linux 5.12+, an open NVIDIA kernel \
                     module, rdma-core 34+)",
                    self.device
                )));
            }
        }
        // SAFETY: the caller keeps the range valid until the layer is dropped.
        let mr = unsafe { (self.lib.reg_mr)(self.pd, base as Ptr, bytes as usize, access) };
        if mr.is_null() {
            let hint =
                if kind == MemoryKind::Device { " (device memory: load nvidia_peermem or use dmabuf)" } else { "" };
            return Err(MkError::system(format!(
                "ibv_reg_mr of {bytes} bytes on {} failed: {}{hint}",
                self.device,
                std::io::Error::last_os_error()
            )));
        }
        self.mrs.push(mr);
        Ok(mr)
    }

    /// dmabuf registration of device memory; None where it is not possible.
    fn register_dmabuf(&mut self, base: u64, bytes: u64, access: c_int) -> Option<Ptr> {
        use cudarc::driver::sys;
        let reg_dmabuf_mr = self.lib.reg_dmabuf_mr?;
        crate::cuda::driver().ok()?;
        // The driver exports whole pages: export the page-aligned cover and register the
        // range at its offset inside it.
        // SAFETY: sysconf has no preconditions.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as u64,
            _ => 4096,
        };
        let (export_base, export_bytes) = page_cover(base, bytes, page);
        let mut fd: c_int = -1;
        // SAFETY: writes a new dmabuf fd for the device range into `fd`.
        let r = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut c_int).cast(),
                export_base,
                export_bytes as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS || fd < 0 {
            return None;
        }
        // SAFETY: fd names the dmabuf covering [base, +bytes) at offset base - export_base;
        // iova = base keeps remote addresses equal to device pointers.
        let mr = unsafe { reg_dmabuf_mr(self.pd, base - export_base, bytes as usize, base, fd, access) };
        // SAFETY: the MR holds its own reference to the dmabuf.
        unsafe { libc::close(fd) };
        if mr.is_null() {
            return None;
        }
        self.mrs.push(mr);
        Some(mr)
    }

    fn modify(&self, qp: Ptr, attr: &mut ibv_qp_attr, mask: c_int, what: &str) -> Result<()> {
        // SAFETY: qp is live; attr is filled for the fields in mask.
        let r = unsafe { (self.lib.modify_qp)(qp, attr, mask) };
        if r != 0 {
            return Err(MkError::system(format!(
                "ibv_modify_qp to {what} failed: {}",
                std::io::Error::from_raw_os_error(r)
            )));
        }
        Ok(())
    }

    fn create_rc(&mut self) -> Result<Ptr> {
        let mut init = ibv_qp_init_attr {
            qp_context: null_mut(),
            send_cq: self.cq,
            recv_cq: self.cq,
            srq: null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: self.send_depth,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: MAX_INLINE,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: pd is live; the QP is destroyed in Drop.
        let qp = unsafe { (self.lib.create_qp)(self.pd, &mut init) };
        if qp.is_null() {
            return Err(errno_error("ibv_create_qp (RC)"));
        }
        // The device writes back what it granted.
        self.send_depth = self.send_depth.min(init.cap.max_send_wr.max(1));
        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            port_num: self.port,
            qp_access_flags: (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE) as u32,
            ..Default::default()
        };
        let mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
        self.modify(qp, &mut attr, mask, "INIT").map(|()| qp)
    }

    fn connect_rc(&self, qp: Ptr, remote: &RdmaBlob, remote_qp: u32) -> Result<()> {
        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: remote.mtu.min(self.port_info.active_mtu),
            dest_qp_num: remote_qp,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ..Default::default()
        };
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = self.port;
        // RoCE has no LIDs: route by GID.
        if remote.lid == 0 || self.port_info.link_layer == IBV_LINK_LAYER_ETHERNET {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = remote.gid;
            attr.ah_attr.grh.hop_limit = 64;
        }
        let mask = IBV_QP_STATE
            | IBV_QP_AV
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER;
        self.modify(qp, &mut attr, mask, "RTR")?;
        // 4.096 µs × 2^14 ≈ 67 ms per try, 7 retries: a dead peer fails a put in about half
        // a second (retry exceeded → mkRemoteError), well inside MK_TIMEOUT_MS.
        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            sq_psn: self.psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            ..Default::default()
        };
        let mask = IBV_QP_STATE
            | IBV_QP_SQ_PSN
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(qp, &mut attr, mask, "RTS")
    }

    fn post_rc(&self, qp: Ptr, wr: &WorkRequest) -> c_int {
        let mut inline_value = [0u8; SIGNAL_MESSAGE_BYTES];
        let (mut sge, opcode, imm, remote_addr, rkey, mut flags) = match wr.op {
            WorkOp::Write { local_addr, lkey, bytes, remote_addr, rkey, imm } => {
                let op = if imm.is_some() { IBV_WR_RDMA_WRITE_WITH_IMM } else { IBV_WR_RDMA_WRITE };
                (ibv_sge { addr: local_addr, length: bytes, lkey }, op, imm.unwrap_or(0), remote_addr, rkey, 0)
            }
            WorkOp::WriteValue { value, remote_addr, rkey } => {
                inline_value[..8].copy_from_slice(&value.to_ne_bytes());
                let sge = ibv_sge { addr: inline_value.as_ptr() as u64, length: 8, lkey: 0 };
                (sge, IBV_WR_RDMA_WRITE, 0, remote_addr, rkey, IBV_SEND_INLINE)
            }
            WorkOp::Send { payload, imm } => {
                inline_value = payload;
                let sge = ibv_sge { addr: inline_value.as_ptr() as u64, length: SIGNAL_MESSAGE_BYTES as u32, lkey: 0 };
                (sge, IBV_WR_SEND_WITH_IMM, imm, 0, 0, IBV_SEND_INLINE)
            }
        };
        if wr.signaled {
            flags |= IBV_SEND_SIGNALED;
        }
        let mut send = ibv_send_wr {
            wr_id: wr.id,
            next: null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode,
            send_flags: flags,
            imm_data: imm.to_be(),
            remote_addr,
            rkey,
            _wr_rest: [0; 5],
            _tail: [0; 7],
        };
        let mut bad: *mut ibv_send_wr = null_mut();
        // SAFETY: post_send is the provider's ibv_post_send (verbs.h calls the same pointer);
        // the request, its SGE and inline bytes live until it returns (inline data is copied).
        unsafe {
            let ops = self.ctx.cast::<u8>().add(CONTEXT_OPS).cast::<c_void>();
            let post: unsafe extern "C" fn(Ptr, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int =
                read_at(ops, OPS_POST_SEND);
            post(qp, &mut send, &mut bad)
        }
    }

    fn status_text(&self, status: u32) -> String {
        // SAFETY: returns a static string.
        unsafe { CStr::from_ptr((self.lib.wc_status_str)(status)) }.to_string_lossy().into_owned()
    }
}

impl Verbs for IbVerbs {
    fn device(&self) -> &str {
        &self.device
    }

    fn ordering(&self) -> SignalOrdering {
        self.ordering
    }

    fn address(&self) -> PortAddress {
        PortAddress { lid: self.port_info.lid, gid: self.gid, mtu: self.port_info.active_mtu, psn: self.psn }
    }

    unsafe fn register(&mut self, region: MemoryRegion) -> Result<MemoryKeys> {
        let mr = self.register_pointer(region.base, region.bytes, region.kind)?;
        // SAFETY: a live MR (abi offsets).
        Ok(unsafe { MemoryKeys { lkey: read_at(mr, MR_LKEY), rkey: read_at(mr, MR_RKEY) } })
    }

    fn create_queue_pair(&mut self, peer: usize) -> Result<u32> {
        let (qp, qpx, receives) = match self.ordering {
            SignalOrdering::WriteThenFlag => (self.create_rc()?, null_mut(), None),
            SignalOrdering::Sequenced => {
                let qp = efa::create_srd_qp(self.lib, self.ctx, self.pd, self.cq, self.send_depth, self.receive_depth)?;
                // SAFETY: qp was created with send_ops_flags, so it has an ibv_qp_ex view.
                let qpx = unsafe { (self.lib.qp_to_qp_ex)(qp) };
                let slots = self.receive_depth;
                let buffer = vec![[0u8; SIGNAL_MESSAGE_BYTES]; slots as usize].into_boxed_slice();
                let bytes = (slots as usize * SIGNAL_MESSAGE_BYTES) as u64;
                let mr = match self.register_pointer(buffer.as_ptr() as u64, bytes, MemoryKind::Host) {
                    Ok(mr) => mr,
                    Err(e) => {
                        // SAFETY: created above, destroyed once.
                        unsafe { (self.lib.destroy_qp)(qp) };
                        return Err(e);
                    }
                };
                if let Err(e) = efa::bring_up(
                    self.lib,
                    qp,
                    self.port,
                    self.psn,
                    self.efa_caps & EFADV_DEVICE_ATTR_CAPS_RNR_RETRY != 0,
                ) {
                    // SAFETY: created above, destroyed once.
                    unsafe { (self.lib.destroy_qp)(qp) };
                    return Err(e);
                }
                (qp, qpx, Some(ReceiveSlots { buffer, mr, free: (0..slots).rev().collect() }))
            }
        };
        // SAFETY: a live QP (abi offset).
        let number: u32 = unsafe { read_at(qp, QP_NUM) };
        self.queue_pairs.insert(peer, QueuePair { qp, qpx, ah: null_mut(), remote_qp: 0, receives });
        self.peer_of_qp.insert(number, peer);
        Ok(number)
    }

    fn connect(&mut self, peer: usize, remote: &RdmaBlob, remote_qp: u32) -> Result<()> {
        let qp = self.queue_pairs.get(&peer).ok_or_else(|| MkError::invalid_usage("connect before create"))?.qp;
        match self.ordering {
            SignalOrdering::WriteThenFlag => self.connect_rc(qp, remote, remote_qp)?,
            SignalOrdering::Sequenced => {
                let mut attr = ibv_ah_attr { is_global: 1, port_num: self.port, ..Default::default() };
                attr.grh.dgid = remote.gid;
                attr.grh.hop_limit = 255;
                // SAFETY: pd is live; the AH is destroyed in Drop.
                let ah = unsafe { (self.lib.create_ah)(self.pd, &mut attr) };
                if ah.is_null() {
                    return Err(errno_error(&format!("ibv_create_ah for rank {peer}")));
                }
                let entry = self.queue_pairs.get_mut(&peer).expect("checked above");
                entry.ah = ah;
            }
        }
        self.queue_pairs.get_mut(&peer).expect("checked above").remote_qp = remote_qp;
        Ok(())
    }

    fn max_write_bytes(&self) -> u64 {
        self.max_write
    }

    fn send_queue_depth(&self) -> u32 {
        self.send_depth
    }

    fn receive_queue_depth(&self) -> u32 {
        self.receive_depth
    }

    fn post_send(&mut self, peer: usize, wr: &WorkRequest) -> std::result::Result<(), PostError> {
        let Some(q) = self.queue_pairs.get(&peer) else {
            return Err(PostError::Failed(MkError::invalid_usage(format!("no queue pair to rank {peer}"))));
        };
        let r = match self.ordering {
            SignalOrdering::WriteThenFlag => self.post_rc(q.qp, wr),
            // SAFETY: qpx is the live SRD queue pair's ibv_qp_ex view, ah its peer's handle.
            SignalOrdering::Sequenced => unsafe { efa::post(q.qpx, q.ah, q.remote_qp, wr) },
        };
        match r {
            0 => Ok(()),
            libc::ENOMEM => Err(PostError::QueueFull),
            e => Err(PostError::Failed(MkError::system(format!(
                "posting to rank {peer} on {} failed: {}",
                self.device,
                std::io::Error::from_raw_os_error(e)
            )))),
        }
    }

    fn post_receives(&mut self, peer: usize, count: u32) -> Result<()> {
        let ctx = self.ctx;
        let q = self.queue_pairs.get_mut(&peer).ok_or_else(|| MkError::invalid_usage("receives before create"))?;
        let slots = q.receives.as_mut().ok_or_else(|| MkError::internal("receives on a queue pair without buffers"))?;
        // SAFETY: a live MR.
        let lkey: u32 = unsafe { read_at(slots.mr, MR_LKEY) };
        for _ in 0..count {
            let slot = slots
                .free
                .pop()
                .ok_or_else(|| MkError::internal(format!("rank {peer}'s receive slots are all posted")))?;
            let mut sge = ibv_sge {
                addr: slots.buffer[slot as usize].as_ptr() as u64,
                length: SIGNAL_MESSAGE_BYTES as u32,
                lkey,
            };
            let mut wr =
                ibv_recv_wr { wr_id: RECEIVE_TAG | slot as u64, next: null_mut(), sg_list: &mut sge, num_sge: 1 };
            let mut bad: *mut ibv_recv_wr = null_mut();
            // SAFETY: the provider's ibv_post_recv; the slot stays registered and unused
            // until its completion returns it.
            let r = unsafe {
                let ops = ctx.cast::<u8>().add(CONTEXT_OPS).cast::<c_void>();
                let post: unsafe extern "C" fn(Ptr, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int =
                    read_at(ops, OPS_POST_RECV);
                post(q.qp, &mut wr, &mut bad)
            };
            if r != 0 {
                slots.free.push(slot);
                return Err(MkError::system(format!(
                    "ibv_post_recv for rank {peer}: {}",
                    std::io::Error::from_raw_os_error(r)
                )));
            }
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        loop {
            // SAFETY: the provider's ibv_poll_cq on our live CQ; wcs has room for its length.
            let n = unsafe {
                let ops = self.ctx.cast::<u8>().add(CONTEXT_OPS).cast::<c_void>();
                let poll: unsafe extern "C" fn(Ptr, c_int, *mut ibv_wc) -> c_int = read_at(ops, OPS_POLL_CQ);
                poll(self.cq, self.wcs.len() as c_int, self.wcs.as_mut_ptr())
            };
            if n < 0 {
                return Err(MkError::system(format!("ibv_poll_cq on {} failed ({n})", self.device)));
            }
            for i in 0..n as usize {
                let wc = self.wcs[i];
                let Some(&peer) = self.peer_of_qp.get(&wc.qp_num) else { continue };
                let status = if wc.status == 0 { Ok(()) } else { Err(self.status_text(wc.status)) };
                let kind = if wc.wr_id & RECEIVE_TAG != 0 {
                    let slot = (wc.wr_id & !RECEIVE_TAG) as usize;
                    let slots = self.queue_pairs.get_mut(&peer).and_then(|q| q.receives.as_mut());
                    let Some(slots) = slots else { continue };
                    let payload = slots.buffer[slot];
                    slots.free.push(slot as u32);
                    let imm = u32::from_be(wc.imm_data);
                    if wc.status != 0 || wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM {
                        CompletionKind::ReceivedWrite { imm }
                    } else {
                        CompletionKind::ReceivedSend { imm, payload }
                    }
                } else {
                    CompletionKind::Sent { id: wc.wr_id }
                };
                out.push(Completion { peer, kind, status });
            }
            if (n as usize) < self.wcs.len() {
                return Ok(());
            }
        }
    }
}

impl Drop for IbVerbs {
    fn drop(&mut self) {
        // Release order: address handles and QPs, MRs, CQ, PD, context.
        let lib = self.lib;
        // Receive buffers are freed (with `queue_pairs`) after their MRs are deregistered.
        let queue_pairs: Vec<QueuePair> = self.queue_pairs.drain().map(|(_, q)| q).collect();
        for q in &queue_pairs {
            // SAFETY: each created by us, destroyed once.
            unsafe {
                if !q.ah.is_null() {
                    (lib.destroy_ah)(q.ah);
                }
                (lib.destroy_qp)(q.qp);
            }
        }
        for mr in self.mrs.drain(..) {
            // SAFETY: registered by us, deregistered once; no QP uses it any more.
            unsafe { (lib.dereg_mr)(mr) };
        }
        drop(queue_pairs);
        // SAFETY: created by us; nothing made from them remains.
        unsafe {
            if !self.cq.is_null() {
                (lib.destroy_cq)(self.cq);
            }
            if !self.pd.is_null() {
                (lib.dealloc_pd)(self.pd);
            }
            (lib.close_device)(self.ctx);
        }
    }
}
