//! The symmetric workspace: one device allocation per rank, mapped into every other rank
//! of the node, plus a host-mapped status block the kernels report errors through.
//!
//! Layout of each rank's allocation: a 1 MiB signal region (u64 flags, zeroed at init;
//! word layout in kernels/common/signals.cuh) followed by the data region
//! (`CommConfig::workspace_bytes`, the minimum over ranks). Peers in other processes map it
//! with CUDA IPC (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`); ranks of the same process
//! (`mkCommInitAll`) use the plain pointer (after enabling peer access when the devices
//! differ). Handles travel through the bootstrap allgather. Never NVLink multicast.
//!
//! The collectives pipeline any message through a fixed partition of the data region, so
//! the workspace never grows: its size only bounds the piece size (a small workspace means
//! more, smaller steps, not failure).
//!
//! Everything is released on drop: IPC mappings closed, host block and allocation freed.

use crate::bootstrap::Bootstrap;
use crate::comm::CommConfig;
use crate::cuda::{self, check, memory::DeviceBuffer, sys, PrimaryContext};
use crate::error::{MkError, Result};
use crate::kernel_abi::{CommStatus, WorkspaceView};
use crate::mk_info;
use std::sync::atomic::{AtomicIsize, Ordering};

/// Bytes of the signal region in front of each rank's data region.
pub const SIGNAL_BYTES: usize = 1 << 20;
/// u64 word index of the abort word in the signal region (signals.cuh MK_SIG_ABORT).
pub const SIG_ABORT_WORD: usize = 0;
/// Most CTA slots the collectives partition the data region into (signals.cuh MK_SIG_MAX_CTAS
/// bounds the flags; 64 keeps pieces large).
pub const MAX_CTA_SLOTS: u32 = 64;
/// Smallest data region: every CTA slot keeps two slots of at least 4 KiB.
pub const MIN_DATA_BYTES: u64 = 64 << 10;
const MIN_REGION_BYTES: u64 = 8 << 10;

/// IPC mappings currently open in this process (tests check it returns to its start).
pub static OPEN_IPC_MAPPINGS: AtomicIsize = AtomicIsize::new(0);
/// Workspaces currently alive in this process.
pub static LIVE_WORKSPACES: AtomicIsize = AtomicIsize::new(0);

/// How this rank reaches one peer's allocation.
enum PeerMapping {
    /// This rank's own allocation, or a rank of the same process: the pointer as is.
    Direct(u64),
    /// Opened with cuIpcOpenMemHandle; closed on drop.
    Ipc(u64),
}

impl PeerMapping {
    fn base(&self) -> u64 {
        match self {
            PeerMapping::Direct(p) | PeerMapping::Ipc(p) => *p,
        }
    }
}

/// What each rank publishes at init (fixed-size, little-endian).
#[derive(Clone, Debug, PartialEq, Eq)]
struct PeerInfo {
    pid: u32,
    host: u64,
    device: i32,
    base: u64,
    data_bytes: u64,
    cta_slots: u32,
    handle: [u8; 64],
}

impl PeerInfo {
    const BYTES: usize = 4 + 8 + 4 + 8 + 8 + 4 + 64;
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::BYTES);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.host.to_le_bytes());
        v.extend_from_slice(&self.device.to_le_bytes());
        v.extend_from_slice(&self.base.to_le_bytes());
        v.extend_from_slice(&self.data_bytes.to_le_bytes());
        v.extend_from_slice(&self.cta_slots.to_le_bytes());
        v.extend_from_slice(&self.handle);
        v
    }
    fn decode(b: &[u8]) -> Result<PeerInfo> {
        if b.len() != Self::BYTES {
            return Err(MkError::internal(format!("workspace exchange: {} bytes from a peer, expected {}", b.len(), Self::BYTES)));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        Ok(PeerInfo {
            pid: u32_at(0),
            host: u64_at(4),
            device: u32_at(12) as i32,
            base: u64_at(16),
            data_bytes: u64_at(24),
            cta_slots: u32_at(32),
            handle: b[36..100].try_into().unwrap(),
        })
    }
}

/// The CTA slots a rank asks for: its grid cap (MK_MAX_CTAS / config), at most
/// MAX_CTA_SLOTS, and no more than the data region can give 8 KiB each.
pub fn wanted_cta_slots(max_ctas: Option<u32>, sm_count: u32, data_bytes: u64) -> u32 {
    let cap = max_ctas.unwrap_or(sm_count).clamp(1, MAX_CTA_SLOTS);
    let by_size = (data_bytes / MIN_REGION_BYTES).max(1).min(u32::MAX as u64) as u32;
    cap.min(by_size)
}

/// A communicator's symmetric workspace. Create it with the communicator's context
/// current; drop it with the same context current.
pub struct SymmetricWorkspace {
    own: DeviceBuffer,
    peers: Vec<PeerMapping>,
    status_host: *mut CommStatus,
    /// What the kernels get.
    pub view: WorkspaceView,
}

// SAFETY: the raw pointer is a pinned host allocation owned by this struct, used with
// volatile accesses only.
unsafe impl Send for SymmetricWorkspace {}
unsafe impl Sync for SymmetricWorkspace {}

impl SymmetricWorkspace {
    /// Collective over the communicator: allocates, exchanges handles, maps every peer.
    /// Requires every rank on one node and at most MK_MAX_PEERS ranks (checked by the caller).
    pub fn create(bootstrap: &Bootstrap, rank: usize, nranks: usize, context: &PrimaryContext, config: &CommConfig) -> Result<Self> {
        let device = context.device;
        let sms = cuda::sm_count(device)? as u32;
        let want_bytes = config.workspace_bytes.max(MIN_DATA_BYTES);
        let want_slots = wanted_cta_slots(config.max_ctas, sms, want_bytes);

        // Status block first, so every later failure path frees it through Drop.
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: allocates pinned, device-mapped host memory.
        check("cuMemHostAlloc(status block)", unsafe {
            sys::cuMemHostAlloc(&mut host, std::mem::size_of::<CommStatus>(), sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        let status_host = host as *mut CommStatus;
        // SAFETY: fresh allocation of the right size.
        unsafe { status_host.write_volatile(CommStatus::default()) };
        let mut ws = SymmetricWorkspace {
            own: DeviceBuffer { ptr: 0, bytes: 0 },
            peers: Vec::new(),
            status_host,
            view: WorkspaceView::default(),
        };
        LIVE_WORKSPACES.fetch_add(1, Ordering::AcqRel);
        let mut status_dev: sys::CUdeviceptr = 0;
        // SAFETY: host came from cuMemHostAlloc with DEVICEMAP.
        check("cuMemHostGetDevicePointer", unsafe { sys::cuMemHostGetDevicePointer_v2(&mut status_dev, host, 0) })?;

        ws.own = DeviceBuffer::alloc(SIGNAL_BYTES + want_bytes as usize)?;
        // SAFETY: the signal region lies inside the allocation.
        check("cuMemsetD8(signal region)", unsafe { sys::cuMemsetD8_v2(ws.own.ptr, 0, SIGNAL_BYTES) })?;
        check("cuCtxSynchronize(after zeroing the signal region)", unsafe { sys::cuCtxSynchronize() })?;

        let pid = std::process::id();
        let host_hash = crate::bootstrap::host_hash();
        let infos: Vec<PeerInfo> = {
            // Other processes need an IPC handle; find out who they are first (cheap).
            let mut handle = [0u8; 64];
            if nranks > 1 {
                let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
                // cuIpcGetMemHandle fails where IPC is unsupported; only peers in other
                // processes need it, so the failure is reported when one opens it.
                // SAFETY: ptr is the base of a cuMemAlloc allocation.
                if unsafe { sys::cuIpcGetMemHandle(&mut h, ws.own.ptr) } == sys::CUresult::CUDA_SUCCESS {
                    handle = h.reserved.map(|c| c as u8);
                }
            }
            let mine = PeerInfo { pid, host: host_hash, device, base: ws.own.ptr, data_bytes: want_bytes, cta_slots: want_slots, handle };
            let all = bootstrap.allgather(&mine.encode())?;
            all.iter().map(|b| PeerInfo::decode(b)).collect::<Result<_>>()?
        };
        let data_bytes = infos.iter().map(|i| i.data_bytes).min().unwrap_or(want_bytes);
        let cta_slots = infos.iter().map(|i| i.cta_slots).min().unwrap_or(want_slots).max(1);

        for (r, info) in infos.iter().enumerate() {
            if r == rank {
                ws.peers.push(PeerMapping::Direct(ws.own.ptr));
            } else if info.pid == pid && info.host == host_hash {
                if info.device != device {
                    let peer_ctx = PrimaryContext::retain(info.device)?;
                    // SAFETY: enables access from the current context to a retained one.
                    let r = unsafe { sys::cuCtxEnablePeerAccess(peer_ctx.ctx, 0) };
                    if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                        check(&format!("cuCtxEnablePeerAccess(device {device} -> {})", info.device), r)?;
                    }
                }
                ws.peers.push(PeerMapping::Direct(info.base));
            } else {
                if info.handle == [0u8; 64] {
                    return Err(MkError::system(format!("rank {r} could not export its workspace with CUDA IPC (cuIpcGetMemHandle failed there)")));
                }
                let h = sys::CUipcMemHandle_st { reserved: info.handle.map(|c| c as std::os::raw::c_char) };
                let mut p: sys::CUdeviceptr = 0;
                // SAFETY: the handle names a live allocation of another process of this node.
                check(
                    &format!("cuIpcOpenMemHandle(workspace of rank {r}, pid {}, device {})", info.pid, info.device),
                    unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32) },
                )?;
                OPEN_IPC_MAPPINGS.fetch_add(1, Ordering::AcqRel);
                ws.peers.push(PeerMapping::Ipc(p));
            }
        }

        let mut view = WorkspaceView {
            status: status_dev,
            data_bytes,
            timeout_ns: config.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: rank as i32,
            nranks: nranks as i32,
            cta_slots: cta_slots as i32,
            ..WorkspaceView::default()
        };
        for (r, m) in ws.peers.iter().enumerate() {
            view.signals[r] = m.base();
            view.data[r] = m.base() + SIGNAL_BYTES as u64;
        }
        ws.view = view;
        mk_info!(Some(rank), "symmetric workspace: {} MiB data + 1 MiB signals per rank, {cta_slots} CTA slots, {} IPC mapping(s)",
            data_bytes >> 20, ws.peers.iter().filter(|m| matches!(m, PeerMapping::Ipc(_))).count());
        Ok(ws)
    }

    /// The error word the kernels recorded (0: none).
    pub fn error_word(&self) -> u32 {
        // SAFETY: pinned host memory owned by self; the GPU writes it, so read volatile.
        unsafe { std::ptr::addr_of!((*self.status_host).error).read_volatile() }
    }

    /// Tells this rank's kernels to stop waiting (mkCommAbort); they raise the peers' abort words.
    pub fn raise_host_abort(&self) {
        // SAFETY: as above.
        unsafe { std::ptr::addr_of_mut!((*self.status_host).host_abort).write_volatile(1) };
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    pub fn host_abort_raised(&self) -> bool {
        // SAFETY: as above.
        unsafe { std::ptr::addr_of!((*self.status_host).host_abort).read_volatile() != 0 }
    }

    /// Number of peers mapped through CUDA IPC.
    pub fn ipc_mappings(&self) -> usize {
        self.peers.iter().filter(|m| matches!(m, PeerMapping::Ipc(_))).count()
    }
}

impl Drop for SymmetricWorkspace {
    fn drop(&mut self) {
        if self.host_abort_raised() {
            // mkCommAbort: the kernels stop within microseconds; let them leave before the
            // memory they use goes away.
            // SAFETY: synchronises the current context.
            let _ = unsafe { sys::cuCtxSynchronize() };
        }
        for m in self.peers.drain(..) {
            if let PeerMapping::Ipc(p) = m {
                // SAFETY: p came from cuIpcOpenMemHandle and is closed once.
                let _ = unsafe { sys::cuIpcCloseMemHandle(p) };
                OPEN_IPC_MAPPINGS.fetch_sub(1, Ordering::AcqRel);
            }
        }
        // `own` frees itself after this body.
        if !self.status_host.is_null() {
            // SAFETY: allocated with cuMemHostAlloc, freed once.
            let _ = unsafe { sys::cuMemFreeHost(self.status_host.cast()) };
            self.status_host = std::ptr::null_mut();
        }
        LIVE_WORKSPACES.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel_abi::MK_MAX_PEERS;

    #[test]
    fn peer_info_round_trips() {
        let mut handle = [0u8; 64];
        handle.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8 * 3);
        let info = PeerInfo { pid: 77, host: 0xdead_beef_0123, device: 3, base: 0x7f00_0000_1000, data_bytes: 1 << 28, cta_slots: 16, handle };
        let enc = info.encode();
        assert_eq!(enc.len(), PeerInfo::BYTES);
        assert_eq!(PeerInfo::decode(&enc).unwrap(), info);
        assert!(PeerInfo::decode(&enc[1..]).is_err());
    }

    #[test]
    fn cta_slots_follow_the_grid_cap_and_the_size() {
        assert_eq!(wanted_cta_slots(None, 132, 256 << 20), MAX_CTA_SLOTS);
        assert_eq!(wanted_cta_slots(Some(8), 132, 256 << 20), 8);
        assert_eq!(wanted_cta_slots(Some(0), 132, 256 << 20), 1);
        assert_eq!(wanted_cta_slots(None, 132, 64 << 10), 8);
        assert_eq!(wanted_cta_slots(None, 132, 1), 1);
    }

    #[test]
    fn signal_layout_matches_the_kernel_header() {
        let header = include_str!("../../kernels/common/signals.cuh");
        let define = |name: &str| -> usize {
            let line = header.lines().find(|l| l.starts_with(&format!("#define {name} "))).unwrap_or_else(|| panic!("{name} missing"));
            line.split_whitespace().nth(2).unwrap().parse().unwrap()
        };
        assert_eq!(define("MK_SIG_ABORT"), SIG_ABORT_WORD);
        assert_eq!(define("MK_SIG_WORDS") * 8, SIGNAL_BYTES);
        assert!(define("MK_SIG_MAX_CTAS") >= MAX_CTA_SLOTS as usize);
        // READY, READY2, FREE for every CTA slot and peer must end before the fused ops' words.
        assert!(define("MK_SIG_READY") + 3 * define("MK_SIG_MAX_CTAS") * MK_MAX_PEERS <= define("MK_SIG_OP_BASE"));
    }
}
