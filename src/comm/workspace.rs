//! The symmetric workspace: one device allocation per rank, mapped into every other rank
//! of the node, plus a host-mapped status block the kernels report errors through.
//! A communicator spanning nodes gets one per node: each rank maps only the ranks of its
//! own node, and its `WorkspaceView` is indexed by local rank (`rank`/`nranks` in the view
//! are the local rank and the node's size; `SymmetricWorkspace::members` maps back to
//! global ranks). Ranks on other nodes are reached through the proxy (src/transport).
//!
//! Layout of each rank's allocation: a 2 MiB signal region (u64 flags, zeroed at init;
//! word layout in kernels/common/signals.cuh) followed by the data region
//! (`CommConfig::workspace_bytes`, the minimum over ranks).
//!
//! Peers in other processes map it, preferably through the virtual-memory API: the owner
//! allocates with `cuMemCreate` and exports a POSIX file descriptor, each importer takes a
//! duplicate of that descriptor with `pidfd_getfd` and maps it (`cuMemImportFromShareableHandle`).
//! An imported handle keeps the physical memory alive, so a peer process that dies (or
//! frees first) cannot turn this rank's pending reads into illegal-address faults: its
//! kernels time out cleanly instead. Where that path is unavailable on any rank (no VMM
//! IPC, no permission for pidfd_getfd), every rank falls back to legacy CUDA IPC
//! (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`), where a dead peer's memory vanishes with it.
//! Ranks of the same process (`mkCommInitAll`) use the plain pointer (granting the other
//! devices access when they differ). Everything travels through the bootstrap allgather.
//! Never NVLink multicast.
//!
//! The collectives pipeline any message through a fixed partition of the data region, so
//! the workspace never grows: its size only bounds the piece size (a small workspace means
//! more, smaller steps, not failure).
//!
//! Everything is released on drop: IPC mappings closed, host block and allocation freed.

use crate::bootstrap::Bootstrap;
use crate::comm::timed_out_wait::{FlagPlace, PeerProgress, TimedOutWait};
use crate::comm::CommConfig;
use crate::cuda::{self, check, memory::DeviceBuffer, sys, PrimaryContext};
use crate::error::{MkError, Result};
use crate::kernel_abi::{CommStatus, WorkspaceView};
use crate::mk_info;
use std::sync::atomic::{AtomicIsize, Ordering};

/// Bytes of the signal region at the start of each rank's allocation.
pub const SIGNAL_BYTES: usize = crate::kernel_abi::MK_SIG_WORDS as usize * 8;
/// Bytes of the collectives' low-latency region, right after the signal region (kernels
/// find it at `signals[r] + SIGNAL_BYTES`); zeroed with the signals, so a line never holds
/// a step it was not written for.
pub const LL_BYTES: usize = crate::kernel_abi::MK_LL_BYTES as usize;
/// Bytes in front of each rank's data region: the signal and low-latency regions.
pub const CONTROL_BYTES: usize = SIGNAL_BYTES + LL_BYTES;
/// u64 word index of the abort word in the signal region.
pub const SIG_ABORT_WORD: usize = crate::kernel_abi::MK_SIG_ABORT as usize;
/// u64 word index of the device-side claim on this rank's first error: kernels arbitrate
/// with a 32-bit CAS on its low half, and the winner's word is copied into the host status
/// block (device atomics on host memory are not atomic over PCIe).
pub const SIG_ERROR_CLAIM_WORD: usize = crate::kernel_abi::MK_SIG_ERROR_CLAIM as usize;
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
    /// Imported from the peer's exported descriptor and mapped here; unmapped on drop.
    Vmm(VmmMapping),
}

impl PeerMapping {
    fn base(&self) -> u64 {
        match self {
            PeerMapping::Direct(p) | PeerMapping::Ipc(p) => *p,
            PeerMapping::Vmm(m) => m.ptr,
        }
    }
}

/// A virtual-memory mapping of a physical allocation (own or imported).
struct VmmMapping {
    ptr: u64,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
}

impl VmmMapping {
    /// Reserves an address range for `handle`, maps it and grants `devices` read/write.
    /// On failure the handle is left to the caller; on success the mapping owns it.
    fn map(handle: sys::CUmemGenericAllocationHandle, size: usize, devices: &[i32]) -> Result<VmmMapping> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: reserves a fresh range of `size` bytes.
        check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) })?;
        let m = VmmMapping { ptr, size, handle };
        // SAFETY: maps the whole allocation at the reserved range.
        if let Err(e) = check("cuMemMap", unsafe { sys::cuMemMap(ptr, size, 0, handle, 0) }) {
            // SAFETY: frees the range reserved above.
            unsafe { sys::cuMemAddressFree(ptr, size) };
            return Err(e);
        }
        for &d in devices {
            let desc = sys::CUmemAccessDesc {
                location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: d },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the range is mapped.
            if let Err(e) =
                check(&format!("cuMemSetAccess(device {d})"), unsafe { sys::cuMemSetAccess(ptr, size, &desc, 1) })
            {
                // SAFETY: undoes the map and reservation above; the caller keeps the handle.
                unsafe {
                    sys::cuMemUnmap(ptr, size);
                    sys::cuMemAddressFree(ptr, size);
                }
                return Err(e);
            }
        }
        Ok(m)
    }

    /// Unmaps and releases this mapping's reference to the physical memory.
    fn unmap(&self) {
        // SAFETY: ptr/size/handle were mapped by `map`; each is undone once.
        unsafe {
            sys::cuMemUnmap(self.ptr, self.size);
            sys::cuMemAddressFree(self.ptr, self.size);
            sys::cuMemRelease(self.handle);
        }
    }
}

/// This rank's own allocation.
enum Backing {
    None,
    Legacy(DeviceBuffer),
    /// With the exported descriptor (closed on drop).
    Vmm(VmmMapping, i32),
}

impl Backing {
    fn base(&self) -> u64 {
        match self {
            Backing::None => 0,
            Backing::Legacy(b) => b.ptr,
            Backing::Vmm(m, _) => m.ptr,
        }
    }
    fn release(&mut self) {
        match std::mem::replace(self, Backing::None) {
            Backing::Vmm(m, fd) => {
                m.unmap();
                // SAFETY: our exported descriptor, closed once.
                unsafe { libc::close(fd) };
            }
            Backing::Legacy(b) => drop(b),
            Backing::None => {}
        }
    }
}

fn vmm_prop(device: i32) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Allocates `bytes` (rounded up to the granularity) with cuMemCreate, maps it for
/// `device` and exports a POSIX descriptor.
fn vmm_alloc(device: i32, bytes: usize) -> Result<(VmmMapping, i32)> {
    let prop = vmm_prop(device);
    let mut gran = 0usize;
    // SAFETY: reads the granularity for a valid property struct.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut gran,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    let size = bytes.div_ceil(gran.max(1)) * gran.max(1);
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: creates a physical allocation.
    check(&format!("cuMemCreate({size} bytes)"), unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) })?;
    let mut fd: i32 = -1;
    // SAFETY: exports the handle as a descriptor into fd.
    if let Err(e) = check("cuMemExportToShareableHandle(POSIX fd)", unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut i32).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    }) {
        // SAFETY: releases the allocation created above.
        unsafe { sys::cuMemRelease(handle) };
        return Err(e);
    }
    match VmmMapping::map(handle, size, &[device]) {
        Ok(m) => Ok((m, fd)),
        Err(e) => {
            // SAFETY: our descriptor and handle, released once.
            unsafe {
                libc::close(fd);
                sys::cuMemRelease(handle);
            }
            Err(e)
        }
    }
}

/// Duplicates descriptor `fd` of process `pid` into this process (Linux pidfd_getfd).
fn take_peer_fd(pid: u32, fd: i32) -> std::result::Result<i32, String> {
    // SAFETY: plain syscalls; descriptors are closed on every path.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) as i32;
        if pidfd < 0 {
            return Err(format!("pidfd_open({pid}): {}", std::io::Error::last_os_error()));
        }
        let got = libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) as i32;
        let err = std::io::Error::last_os_error();
        libc::close(pidfd);
        if got < 0 {
            return Err(format!("pidfd_getfd(pid {pid}, fd {fd}): {err}"));
        }
        Ok(got)
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
    /// 1: `base` is a cuMemCreate allocation exported as descriptor `fd` (`alloc_bytes` long).
    vmm: u32,
    fd: i32,
    alloc_bytes: u64,
    /// Legacy CUDA IPC handle (all zero when none).
    handle: [u8; 64],
}

impl PeerInfo {
    const BYTES: usize = 4 + 8 + 4 + 8 + 8 + 4 + 4 + 4 + 8 + 64;
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::BYTES);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.host.to_le_bytes());
        v.extend_from_slice(&self.device.to_le_bytes());
        v.extend_from_slice(&self.base.to_le_bytes());
        v.extend_from_slice(&self.data_bytes.to_le_bytes());
        v.extend_from_slice(&self.cta_slots.to_le_bytes());
        v.extend_from_slice(&self.vmm.to_le_bytes());
        v.extend_from_slice(&self.fd.to_le_bytes());
        v.extend_from_slice(&self.alloc_bytes.to_le_bytes());
        v.extend_from_slice(&self.handle);
        v
    }
    fn decode(b: &[u8]) -> Result<PeerInfo> {
        if b.len() != Self::BYTES {
            return Err(MkError::internal(format!(
                "workspace exchange: {} bytes from a peer, expected {}",
                b.len(),
                Self::BYTES
            )));
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
            vmm: u32_at(36),
            fd: u32_at(40) as i32,
            alloc_bytes: u64_at(44),
            handle: b[52..116].try_into().unwrap(),
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

/// Where `rank` sits in the view of its node's workspace: (its slot = local rank, slots).
/// `members` are the node's ranks in local-rank order (each once, `rank` among them, all
/// below `nranks`); at most MK_MAX_PEERS of them, since the view maps that many.
pub fn node_view_slots(members: &[usize], rank: usize, nranks: usize) -> Result<(usize, usize)> {
    let bad = |why: &str| {
        Err(MkError::internal(format!("workspace members {members:?} of rank {rank} (of {nranks}): {why}")))
    };
    if members.iter().enumerate().any(|(i, &m)| m >= nranks || members[..i].contains(&m)) {
        return bad("a member is out of range or repeated");
    }
    let Some(local) = members.iter().position(|&m| m == rank) else { return bad("the rank itself is missing") };
    if members.len() > crate::kernel_abi::MK_MAX_PEERS {
        return Err(MkError::invalid_usage(format!(
            "{} ranks on one node; the NVLink data plane maps at most {}",
            members.len(),
            crate::kernel_abi::MK_MAX_PEERS
        )));
    }
    Ok((local, members.len()))
}

/// A communicator's symmetric workspace. Create it with the communicator's context
/// current; drop it with the same context current.
pub struct SymmetricWorkspace {
    own: Backing,
    peers: Vec<PeerMapping>,
    status_host: *mut CommStatus,
    /// "vmm" or "legacy IPC (why)" or "single process".
    pub transport: String,
    /// The global rank of each view slot (`view.data[l]` is rank `members[l]`'s region).
    pub members: Vec<usize>,
    /// What the kernels get.
    pub view: WorkspaceView,
}

// SAFETY: the raw pointer is a pinned host allocation owned by this struct, used with
// volatile accesses only.
unsafe impl Send for SymmetricWorkspace {}
unsafe impl Sync for SymmetricWorkspace {}

fn zero_signals(base: u64) -> Result<()> {
    // SAFETY: the signal and low-latency regions lie at the start of the allocation.
    check("cuMemsetD8(signal and LL regions)", unsafe { sys::cuMemsetD8_v2(base, 0, CONTROL_BYTES) })?;
    // SAFETY: plain synchronisation of the current context.
    check("cuCtxSynchronize(after zeroing the signal region)", unsafe { sys::cuCtxSynchronize() })
}

fn decode_all(blocks: Vec<Vec<u8>>) -> Result<Vec<PeerInfo>> {
    blocks.iter().map(|b| PeerInfo::decode(b)).collect()
}

impl SymmetricWorkspace {
    /// Collective over the communicator (every rank calls it): allocates, exchanges
    /// handles, and maps the ranks of `members` — this rank's node, in local-rank order
    /// (`Topology::node_ranks`; all ranks when the communicator is on one node). The view
    /// is indexed by local rank (`node_view_slots`). At most MK_MAX_PEERS members (checked
    /// by the caller). Sizes (`data_bytes`, `cta_slots`) are the minimum over *all* ranks,
    /// so offsets inside the regions agree across nodes too (inter-node puts rely on it).
    pub fn create(
        bootstrap: &Bootstrap,
        rank: usize,
        nranks: usize,
        members: &[usize],
        context: &PrimaryContext,
        config: &CommConfig,
    ) -> Result<Self> {
        let (local_rank, local_size) = node_view_slots(members, rank, nranks)?;
        let device = context.device;
        let sms = cuda::sm_count(device)? as u32;
        let want_bytes = config.workspace_bytes.max(MIN_DATA_BYTES);
        let want_slots = wanted_cta_slots(config.max_ctas, sms, want_bytes);
        // Signals, the LL region, the collectives' data region, then an equal region for
        // the fused ops.
        let alloc_bytes = CONTROL_BYTES + 2 * want_bytes as usize;

        // Status block first, so every later failure path frees it through Drop.
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: allocates pinned, device-mapped host memory.
        check("cuMemHostAlloc(status block)", unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                std::mem::size_of::<CommStatus>(),
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        })?;
        let status_host = host as *mut CommStatus;
        // SAFETY: fresh allocation of the right size.
        unsafe { status_host.write_volatile(CommStatus::default()) };
        let mut ws = SymmetricWorkspace {
            own: Backing::None,
            peers: Vec::new(),
            status_host,
            transport: String::new(),
            members: Vec::new(),
            view: WorkspaceView::default(),
        };
        LIVE_WORKSPACES.fetch_add(1, Ordering::AcqRel);
        let mut status_dev: sys::CUdeviceptr = 0;
        // SAFETY: host came from cuMemHostAlloc with DEVICEMAP.
        check("cuMemHostGetDevicePointer", unsafe { sys::cuMemHostGetDevicePointer_v2(&mut status_dev, host, 0) })?;

        let pid = std::process::id();
        let host_hash = crate::bootstrap::host_hash();
        let mut info = PeerInfo {
            pid,
            host: host_hash,
            device,
            base: 0,
            data_bytes: want_bytes,
            cta_slots: want_slots,
            vmm: 0,
            fd: -1,
            alloc_bytes: alloc_bytes as u64,
            handle: [0; 64],
        };

        // Round 1: everyone tries the VMM allocation and says whether it worked.
        let mut vmm_failure = None;
        if nranks > 1 {
            match vmm_alloc(device, alloc_bytes) {
                Ok((m, fd)) => {
                    info.base = m.ptr;
                    info.alloc_bytes = m.size as u64;
                    info.vmm = 1;
                    info.fd = fd;
                    ws.own = Backing::Vmm(m, fd);
                    zero_signals(info.base)?;
                }
                Err(e) => vmm_failure = Some(format!("rank {rank}: {}", e.message)),
            }
        }
        let infos = decode_all(bootstrap.allgather(&info.encode())?)?;
        let sharing = ranks_sharing_the_context_of(&infos, rank);
        if !sharing.is_empty() {
            crate::log::warn(
                Some(rank),
                format_args!(
                    "ranks {sharing:?} of this communicator share this rank's GPU and process (one context): \
                     each rank's stream needs a hardware queue of its own, or a call can stall until \
                     MK_TIMEOUT_MS (docs/thread-safety.md)"
                ),
            );
        }
        let remote = |i: &PeerInfo| !(i.pid == pid && i.host == host_hash);
        let mut use_vmm = nranks > 1 && infos.iter().all(|i| i.vmm == 1);
        let mut imported: Vec<Option<i32>> = vec![None; nranks];
        if use_vmm {
            // Round 2: take every remote peer's descriptor; all must succeed.
            let mut my_failure = None;
            for (r, i) in infos.iter().enumerate() {
                if r != rank && remote(i) && members.contains(&r) {
                    match take_peer_fd(i.pid, i.fd) {
                        Ok(fd) => imported[r] = Some(fd),
                        Err(why) => {
                            my_failure = Some(format!("rank {rank}: {why}"));
                            break;
                        }
                    }
                }
            }
            let verdicts = bootstrap.allgather(my_failure.as_deref().unwrap_or("").as_bytes())?;
            if let Some(v) = verdicts.iter().find(|v| !v.is_empty()) {
                vmm_failure = Some(String::from_utf8_lossy(v).into_owned());
                use_vmm = false;
            }
        } else if vmm_failure.is_none() && nranks > 1 {
            vmm_failure = Some("another rank could not allocate with cuMemCreate".into());
        }

        let infos = if use_vmm {
            ws.transport = "vmm (cuMemCreate + POSIX fd)".into();
            infos
        } else {
            for fd in imported.iter_mut().filter_map(|f| f.take()) {
                // SAFETY: a descriptor duplicated into this process, unused.
                unsafe { libc::close(fd) };
            }
            // Legacy path: a plain allocation, exported with cuIpcGetMemHandle when needed.
            ws.own.release();
            let buf = DeviceBuffer::alloc(alloc_bytes)?;
            zero_signals(buf.ptr)?;
            info.base = buf.ptr;
            info.vmm = 0;
            info.fd = -1;
            info.alloc_bytes = alloc_bytes as u64;
            ws.own = Backing::Legacy(buf);
            let any_remote = members.iter().any(|&r| remote(&infos[r]));
            if any_remote {
                let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
                // cuIpcGetMemHandle fails where IPC is unsupported; the peers that need it
                // report that when they try to open it.
                // SAFETY: ptr is the base of a cuMemAlloc allocation.
                if unsafe { sys::cuIpcGetMemHandle(&mut h, info.base) } == sys::CUresult::CUDA_SUCCESS {
                    info.handle = h.reserved.map(|c| c as u8);
                }
                ws.transport = format!("legacy CUDA IPC ({})", vmm_failure.clone().unwrap_or_default());
            } else {
                ws.transport = "single process".into();
            }
            decode_all(bootstrap.allgather(&info.encode())?)?
        };
        let data_bytes = infos.iter().map(|i| i.data_bytes).min().unwrap_or(want_bytes);
        let cta_slots = infos.iter().map(|i| i.cta_slots).min().unwrap_or(want_slots).max(1);

        // In-process peers on other devices read and write this allocation directly.
        let other_local_devices: Vec<i32> =
            members.iter().map(|&r| &infos[r]).filter(|i| !remote(i) && i.device != device).map(|i| i.device).collect();
        for &d in &other_local_devices {
            match &ws.own {
                Backing::Vmm(m, _) => {
                    let desc = sys::CUmemAccessDesc {
                        location: sys::CUmemLocation {
                            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                            id: d,
                        },
                        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                    };
                    // SAFETY: our mapped range.
                    check(&format!("cuMemSetAccess(for device {d})"), unsafe {
                        sys::cuMemSetAccess(m.ptr, m.size, &desc, 1)
                    })?;
                }
                _ => {
                    let peer_ctx = PrimaryContext::retain(d)?;
                    // SAFETY: enables access from the current context to a retained one.
                    let r = unsafe { sys::cuCtxEnablePeerAccess(peer_ctx.ctx, 0) };
                    if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                        check(&format!("cuCtxEnablePeerAccess(device {device} -> {d})"), r)?;
                    }
                }
            }
        }
        // Ranks that share this rank's CUDA context (threads of this process on its device):
        // every kernel loaded before the barrier below, so that none loads while a peer's op
        // is in flight (ops::preload_all). Best effort: a failure brings back the lazy load.
        let shares_context = members.iter().any(|&r| r != rank && !remote(&infos[r]) && infos[r].device == device);
        if shares_context {
            if let Err(e) = crate::cuda::preload_all() {
                mk_info!(Some(rank), "kernels not preloaded for the ranks sharing this context: {e}");
            }
        }
        // Round 3 (or 2): everyone has granted access before anyone maps or launches.
        bootstrap.barrier()?;

        for &r in members {
            let i = &infos[r];
            if r == rank {
                ws.peers.push(PeerMapping::Direct(ws.own.base()));
            } else if !remote(i) {
                ws.peers.push(PeerMapping::Direct(i.base));
            } else if use_vmm {
                let fd = imported[r].take().expect("taken in round 2");
                let mut h: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: fd is a descriptor of the peer's exported allocation.
                let rc = unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut h,
                        fd as usize as *mut std::ffi::c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                };
                // SAFETY: the import holds its own reference.
                unsafe { libc::close(fd) };
                check(&format!("cuMemImportFromShareableHandle(workspace of rank {r}, pid {})", i.pid), rc)?;
                let m = match VmmMapping::map(h, i.alloc_bytes as usize, &[device]) {
                    Ok(m) => m,
                    Err(e) => {
                        // SAFETY: the imported handle, released once.
                        unsafe { sys::cuMemRelease(h) };
                        return Err(e.context(format!("mapping the workspace of rank {r}")));
                    }
                };
                OPEN_IPC_MAPPINGS.fetch_add(1, Ordering::AcqRel);
                ws.peers.push(PeerMapping::Vmm(m));
            } else {
                if i.handle == [0u8; 64] {
                    return Err(MkError::system(format!(
                        "rank {r} could not export its workspace with CUDA IPC (cuIpcGetMemHandle failed there)"
                    )));
                }
                let h = sys::CUipcMemHandle_st { reserved: i.handle.map(|c| c as std::os::raw::c_char) };
                let mut p: sys::CUdeviceptr = 0;
                // SAFETY: the handle names a live allocation of another process of this node.
                check(
                    &format!("cuIpcOpenMemHandle(workspace of rank {r}, pid {}, device {})", i.pid, i.device),
                    unsafe {
                        sys::cuIpcOpenMemHandle_v2(
                            &mut p,
                            h,
                            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                        )
                    },
                )?;
                OPEN_IPC_MAPPINGS.fetch_add(1, Ordering::AcqRel);
                ws.peers.push(PeerMapping::Ipc(p));
            }
        }
        for fd in imported.iter_mut().filter_map(|f| f.take()) {
            // SAFETY: unused duplicate.
            unsafe { libc::close(fd) };
        }

        let mut view = WorkspaceView {
            status: status_dev,
            data_bytes,
            op_bytes: data_bytes,
            timeout_ns: config.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: local_rank as i32,
            nranks: local_size as i32,
            cta_slots: cta_slots as i32,
            ..WorkspaceView::default()
        };
        for (l, m) in ws.peers.iter().enumerate() {
            view.signals[l] = m.base();
            view.data[l] = m.base() + CONTROL_BYTES as u64;
        }
        ws.view = view;
        ws.members = members.to_vec();
        mk_info!(
            Some(rank),
            "symmetric workspace: {} MiB data + {} MiB signal and LL regions per rank, {cta_slots} CTA slots, peers mapped by {}",
            data_bytes >> 20,
            CONTROL_BYTES >> 20,
            ws.transport
        );
        Ok(ws)
    }

    /// The error word the kernels recorded (0: none).
    pub fn error_word(&self) -> u32 {
        // SAFETY: pinned host memory owned by self; the GPU writes it, so read volatile.
        unsafe { std::ptr::addr_of!((*self.status_host).error).read_volatile() }
    }

    /// The first wait of this rank that timed out, as its kernel recorded it (None: none did).
    pub fn timed_out_wait(&self) -> Option<TimedOutWait> {
        // SAFETY: as above; the kernel writes these before `error` (with a system fence
        // between), and they are read only after `error` was seen nonzero.
        let (flag, target, seen, progress_word, progress) = unsafe {
            (
                std::ptr::addr_of!((*self.status_host).timeout_flag).read_volatile(),
                std::ptr::addr_of!((*self.status_host).timeout_target).read_volatile(),
                std::ptr::addr_of!((*self.status_host).timeout_seen).read_volatile(),
                std::ptr::addr_of!((*self.status_host).timeout_progress_word).read_volatile(),
                std::ptr::addr_of!((*self.status_host).timeout_progress).read_volatile(),
            )
        };
        let progress = (progress_word != 0).then_some(PeerProgress { word: progress_word, value: progress });
        (flag != 0).then_some(TimedOutWait { flag, target, seen, progress })
    }

    /// The rank and word of a device address inside one of the mapped signal regions.
    pub fn place_of(&self, addr: u64) -> Option<FlagPlace> {
        self.members.iter().enumerate().find_map(|(l, &rank)| {
            let base = self.view.signals[l];
            (base != 0 && addr >= base && addr < base + SIGNAL_BYTES as u64)
                .then(|| FlagPlace { rank, word: ((addr - base) / 8) as u32 })
        })
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

    /// Number of peers mapped from other processes.
    pub fn ipc_mappings(&self) -> usize {
        self.peers.iter().filter(|m| !matches!(m, PeerMapping::Direct(_))).count()
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
            match m {
                PeerMapping::Ipc(p) => {
                    // SAFETY: p came from cuIpcOpenMemHandle and is closed once.
                    let _ = unsafe { sys::cuIpcCloseMemHandle(p) };
                    OPEN_IPC_MAPPINGS.fetch_sub(1, Ordering::AcqRel);
                }
                PeerMapping::Vmm(v) => {
                    v.unmap();
                    OPEN_IPC_MAPPINGS.fetch_sub(1, Ordering::AcqRel);
                }
                PeerMapping::Direct(_) => {}
            }
        }
        self.own.release();
        if !self.status_host.is_null() {
            // SAFETY: allocated with cuMemHostAlloc, freed once.
            let _ = unsafe { sys::cuMemFreeHost(self.status_host.cast()) };
            self.status_host = std::ptr::null_mut();
        }
        LIVE_WORKSPACES.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The other ranks whose process, host and device are `rank`'s: they share its CUDA context,
/// and with it the hardware queues its streams go to (decision 0083).
fn ranks_sharing_the_context_of(infos: &[PeerInfo], rank: usize) -> Vec<usize> {
    let me = &infos[rank];
    (0..infos.len())
        .filter(|&r| r != rank && infos[r].pid == me.pid && infos[r].host == me.host && infos[r].device == me.device)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel_abi::MK_MAX_PEERS;

    #[test]
    fn ranks_share_a_context_only_with_process_host_and_device_alike() {
        let peer = |pid, host, device| PeerInfo {
            pid,
            host,
            device,
            base: 0,
            data_bytes: 0,
            cta_slots: 0,
            vmm: 0,
            fd: -1,
            alloc_bytes: 0,
            handle: [0; 64],
        };
        // Rank 0's twins: rank 3 alone (rank 1 another device, 2 another process, 4 another host).
        let infos = [peer(7, 1, 0), peer(7, 1, 1), peer(8, 1, 0), peer(7, 1, 0), peer(7, 2, 0)];
        assert_eq!(ranks_sharing_the_context_of(&infos, 0), vec![3]);
        assert_eq!(ranks_sharing_the_context_of(&infos, 3), vec![0]);
        assert!(ranks_sharing_the_context_of(&infos, 1).is_empty());
        assert!(ranks_sharing_the_context_of(&infos, 4).is_empty());
    }

    #[test]
    fn peer_info_round_trips() {
        let mut handle = [0u8; 64];
        handle.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8 * 3);
        let info = PeerInfo {
            pid: 77,
            host: 0xdead_beef_0123,
            device: 3,
            base: 0x7f00_0000_1000,
            data_bytes: 1 << 28,
            cta_slots: 16,
            vmm: 1,
            fd: 42,
            alloc_bytes: (1 << 28) + (2 << 20),
            handle,
        };
        let enc = info.encode();
        assert_eq!(enc.len(), PeerInfo::BYTES);
        assert_eq!(PeerInfo::decode(&enc).unwrap(), info);
        assert!(PeerInfo::decode(&enc[1..]).is_err());
    }

    #[test]
    fn the_view_is_indexed_by_local_rank() {
        use crate::transport::topology::{node_of_ranks, Topology};
        // Two emulated nodes of two: rank 3 is slot 1 of node 1's view [2, 3].
        let nodes = node_of_ranks(&[0; 4], Some(2));
        let t = Topology::new(3, &nodes).unwrap();
        assert_eq!(node_view_slots(&t.node_ranks, 3, 4).unwrap(), (1, 2));
        // Interleaved hosts: node 0 is ranks [0, 2]; rank 2 is slot 1.
        let t = Topology::new(2, &[0, 1, 0, 1]).unwrap();
        assert_eq!(t.node_ranks, vec![0, 2]);
        assert_eq!(node_view_slots(&t.node_ranks, 2, 4).unwrap(), (1, 2));
        // One node: the view is the whole communicator, slot = rank.
        assert_eq!(node_view_slots(&[0, 1, 2], 1, 3).unwrap(), (1, 3));
        assert_eq!(node_view_slots(&[0, 1], 2, 4).unwrap_err().code, crate::error::mkResult_t::mkInternalError);
        assert_eq!(node_view_slots(&[0, 0], 0, 4).unwrap_err().code, crate::error::mkResult_t::mkInternalError);
        assert_eq!(node_view_slots(&[0, 5], 0, 4).unwrap_err().code, crate::error::mkResult_t::mkInternalError);
        let nine: Vec<usize> = (0..9).collect();
        assert_eq!(node_view_slots(&nine, 0, 9).unwrap_err().code, crate::error::mkResult_t::mkInvalidUsage);
    }

    #[test]
    fn cta_slots_follow_the_grid_cap_and_the_size() {
        assert_eq!(wanted_cta_slots(None, 132, 256 << 20), MAX_CTA_SLOTS);
        assert_eq!(wanted_cta_slots(Some(8), 132, 256 << 20), 8);
        assert_eq!(wanted_cta_slots(Some(0), 132, 256 << 20), 1);
        assert_eq!(wanted_cta_slots(None, 132, 64 << 10), 8);
        assert_eq!(wanted_cta_slots(None, 132, 1), 1);
    }

    /// The Python package sizes a communicator's memory as the library does
    /// (python/src/mkernel/comm.py `_CONTROL_BYTES`, "N << M").
    #[test]
    fn the_python_package_knows_the_control_regions() {
        let py = include_str!("../../python/src/mkernel/comm.py");
        let line = py.lines().find_map(|l| l.strip_prefix("_CONTROL_BYTES = ")).expect("_CONTROL_BYTES in comm.py");
        let (n, shift) = line.split_once("<<").expect("N << M");
        let value = n.trim().parse::<usize>().unwrap() << shift.trim().parse::<u32>().unwrap();
        assert_eq!(value, CONTROL_BYTES, "python/src/mkernel/comm.py _CONTROL_BYTES");
    }

    #[test]
    fn signal_layout_fits_the_slots() {
        use crate::kernel_abi::{MK_SIG_MAX_CTAS, MK_SIG_OP_BASE, MK_SIG_READY, MK_SIG_SEQ};
        assert!(SIG_ERROR_CLAIM_WORD < MK_SIG_SEQ as usize);
        assert_eq!(SIGNAL_BYTES, 2 << 20);
        const { assert!(MK_SIG_MAX_CTAS >= MAX_CTA_SLOTS) };
        // READY, READY2, FREE for every CTA slot and peer must end before the fused ops' words.
        const { assert!(MK_SIG_READY as usize + 3 * MK_SIG_MAX_CTAS as usize * MK_MAX_PEERS <= MK_SIG_OP_BASE as usize) };
        // The LL region holds every LL CTA's two parities of every source's lines, and the
        // data region after it stays 256-byte aligned (the collectives' pieces rely on it).
        use crate::kernel_abi::{MK_LL_MAX_CTAS, MK_LL_SOURCE_BYTES};
        assert_eq!(LL_BYTES, MK_LL_MAX_CTAS as usize * 2 * MK_MAX_PEERS * MK_LL_SOURCE_BYTES as usize);
        const { assert!(MK_LL_MAX_CTAS <= MK_SIG_MAX_CTAS) };
        assert_eq!(CONTROL_BYTES % 256, 0);
    }
}
