//! Parameter structs shared by Rust launchers and CUDA kernels. build.rs turns this file
//! into `mk_kernel_abi.h` (cbindgen), which every kernel includes, so the two sides cannot
//! disagree about a field's offset. Keep it plain `#[repr(C)]` data with fixed-size fields.

/// Fills a device buffer with reproducible pseudo-random values, uniform in [-1, 1)
/// scaled by `scale` (test and benchmark inputs: never zeros).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FillRandomParams {
    /// Device pointer to the buffer.
    pub data: u64,
    /// Number of elements.
    pub count: u64,
    /// Seed; different seeds give unrelated streams.
    pub seed: u64,
    /// Element type as an `mkDataType_t` value (floating types only).
    pub dtype: i32,
    pub scale: f32,
}

/// Most ranks one communicator's NVLink data plane maps (one node: up to 8 GPUs, or up to
/// 8 ranks sharing GPUs).
pub const MK_MAX_PEERS: usize = 8;

/// A communicator's symmetric workspace as a kernel sees it: every rank's buffers mapped
/// into this rank's address space. Built once at init (src/comm/workspace.rs) and passed by
/// value inside each op's parameter struct.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct WorkspaceView {
    /// Data region of each rank's workspace as mapped here (index = rank; own one included).
    pub data: [u64; MK_MAX_PEERS],
    /// Signal region (u64 flag words, layout in kernels/common/signals.cuh) of each rank.
    pub signals: [u64; MK_MAX_PEERS],
    /// Device pointer to this rank's host-mapped `CommStatus`.
    pub status: u64,
    /// Bytes in each rank's data region.
    pub data_bytes: u64,
    /// Bound on every wait, in nanoseconds of %globaltimer (MK_TIMEOUT_MS).
    pub timeout_ns: u64,
    pub rank: i32,
    pub nranks: i32,
    /// The collectives' fixed partition of the data region: CTA b owns
    /// data_bytes / cta_slots bytes at b * (data_bytes / cta_slots).
    pub cta_slots: i32,
    pub reserved: i32,
}

/// Host-mapped status block of one rank: the kernels write it, the host reads it in
/// mkCommGetAsyncError / before every op.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CommStatus {
    /// 0, or the first error a kernel of this rank hit (encoded as in `ops::collectives::ErrorWord`).
    pub error: u32,
    /// Set by mkCommAbort: this rank's kernels stop waiting and raise their peers' abort words.
    pub host_abort: u32,
    pub reserved: [u32; 14],
}

/// Parameters of the collective kernels (kernels/collectives.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CollectiveParams {
    pub ws: WorkspaceView,
    pub send: u64,
    pub recv: u64,
    /// Elements per rank segment (AllGather: sendcount; ReduceScatter: recvcount;
    /// AllReduce: count, treated as nranks slices of each piece).
    pub count: u64,
    /// Elements per piece: one CTA moves one piece per step.
    pub chunk: u64,
    /// 1 AllGather, 2 ReduceScatter, 3 AllReduce.
    pub kind: i32,
    pub dtype: i32,
    pub op: i32,
    /// Bytes per element.
    pub elem_size: i32,
}

/// Parameters of the benchmark's on-device result check (kernels/collectives.cu): inputs
/// of rank p were made by mk_fill_random(seed_base + p, scale 1) as float32.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CollectiveCheckParams {
    pub out: u64,
    /// Device pointer to one u64 that receives the number of wrong elements.
    pub wrong: u64,
    pub count: u64,
    pub seed_base: u64,
    pub kind: i32,
    pub op: i32,
    pub rank: i32,
    pub nranks: i32,
}
