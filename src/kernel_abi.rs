//! Everything the Rust launchers and the CUDA kernels must agree on: parameter structs,
//! the signal region's word map (shared words and one range per op), operation codes and
//! wait codes of error words, and tile constants. build.rs turns this file into
//! `mk_kernel_abi.h` (cbindgen), which every kernel includes, so the two sides cannot
//! disagree about a field's offset or a word's index. Keep it plain `#[repr(C)]` data with
//! fixed-size fields, `#[repr(u32)]` enums and constant expressions cbindgen can emit.
//! Result codes, data types and reduction ops come from the public header (mkernel.h),
//! which the kernels include as well.

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
    /// Bytes of the fused ops' region, which follows the data region (at
    /// `data[r] + data_bytes`). Kept apart from the collectives' staging so a fused op and
    /// a collective issued back to back never write into each other's buffers.
    pub op_bytes: u64,
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
    /// The first timed-out wait of this rank, written before `error` by the wait whose
    /// error word won (signals.cuh mk_record_timeout): the address of the flag it polled
    /// (0: no wait timed out), the value it waited for and the value it last read.
    pub timeout_flag: u64,
    pub timeout_target: u64,
    pub timeout_seen: u64,
    /// Beside a timed-out wait for a peer's flag, where the peer's op stood: the address of
    /// the peer's progress word for that op (0: the op keeps none) and its value then.
    /// Only the MoE dispatch keeps one (`MOE_PROGRESS`).
    pub timeout_progress_word: u64,
    pub timeout_progress: u64,
    pub reserved: [u32; 4],
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
    /// Dynamic shared memory the kernel was launched with, in which its copies and
    /// reductions stage their loads (cp.async); 0 keeps the loads in registers.
    pub stage_bytes: u32,
    /// How the pieces move: an `MkProtocol` (every rank plans the same one).
    pub protocol: u32,
}

/// How a collective moves its pieces between ranks (`CollectiveParams::protocol`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MkProtocol {
    /// Each rank stages its piece in its own slot of the data region and flags it; the
    /// peers pull it and flag that they have read it (bandwidth: large messages).
    #[default]
    Simple = 0,
    /// Each rank pushes every 8 bytes of its piece, with the step in the same 16-byte line,
    /// into each peer's LL region; a receiver polls its own region until a line carries the
    /// step (latency: small messages, one one-way trip and no flag round trip).
    LowLatency = 1,
}

/// Threads per CTA of the collective kernels (kernels/collectives.cu).
pub const MK_COLLECTIVE_THREADS: u32 = 512;

/// CTAs that have an area in the LL region: a low-latency call's grid is at most this.
pub const MK_LL_MAX_CTAS: u32 = 16;
/// Payload bytes of one low-latency piece from one source (one CTA step): one 8-byte line
/// per thread of a collective CTA.
pub const MK_LL_PIECE_BYTES: u32 = 8 * MK_COLLECTIVE_THREADS;
/// Bytes of a piece's lines from one source: 16 per 8 bytes of payload.
pub const MK_LL_SOURCE_BYTES: u32 = 2 * MK_LL_PIECE_BYTES;
/// Bytes of each rank's LL region, right after its signal region (zeroed with it): per CTA
/// b < MK_LL_MAX_CTAS, per step parity, per source rank, one piece's lines, at
/// ((b * 2 + (step & 1)) * MK_MAX_PEERS + source) * MK_LL_SOURCE_BYTES.
pub const MK_LL_BYTES: u32 = MK_LL_MAX_CTAS * 2 * MK_MAX_PEERS as u32 * MK_LL_SOURCE_BYTES;

/// Threads per CTA of the hierarchical collective kernels (kernels/hier_collectives.cu).
pub const MK_HIER_THREADS: u32 = 512;

/// Most nodes a hierarchical collective spans (kernels/common/signals.cuh gives every CTA
/// slot MK_MAX_NODES words per network flag).
pub const MK_MAX_NODES: usize = 8;
/// Entries of `HierCollectiveParams::rank_of` (MK_MAX_NODES × MK_MAX_PEERS).
pub const MK_MAX_NODE_RANKS: usize = 64;

/// Parameters of the hierarchical collectives (kernels/hier_collectives.cu): NVLink within
/// the node through `ws` (indexed by local rank), GPU i ↔ GPU i between nodes through the
/// proxy ring. Every byte offset below is inside a CTA's slot of the data region: CTA b's
/// slot for step s starts at `b * region_bytes + (s & 1) * slot_bytes` (the same offset on
/// every rank of every node, so a put's source and destination offsets are symmetric).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HierCollectiveParams {
    /// This node's workspace (rank/nranks in it are the local rank and the node's size).
    pub ws: WorkspaceView,
    /// This rank's proxy ring.
    pub ring: ProxyRingView,
    pub send: u64,
    pub recv: u64,
    /// Elements per rank segment (as `CollectiveParams::count`).
    pub count: u64,
    /// Elements per piece (one CTA step).
    pub chunk: u64,
    /// AllReduce: elements of each owner's slice of a piece (owner q: [q·slice, (q+1)·slice)).
    pub slice: u64,
    /// Bytes of one sub-area (a piece, a node partial or a slice), a multiple of 16.
    pub sub_bytes: u64,
    /// Slot offsets of the staging area, outbox, inbox and gather area (unused ones 0).
    pub stage_off: u64,
    pub outbox_off: u64,
    pub inbox_off: u64,
    pub gather_off: u64,
    /// Each CTA's part of the data region, and one of its two slots.
    pub region_bytes: u64,
    pub slot_bytes: u64,
    /// 1 AllGather, 2 ReduceScatter, 3 AllReduce.
    pub kind: i32,
    pub dtype: i32,
    pub op: i32,
    pub elem_size: i32,
    /// This rank and the communicator's size (global).
    pub rank: i32,
    pub nranks: i32,
    /// This rank's node and the number of nodes.
    pub node: i32,
    pub nodes: i32,
    /// rank_of[m * MK_MAX_PEERS + l]: the global rank of local rank l on node m.
    pub rank_of: [i32; MK_MAX_NODE_RANKS],
}

impl Default for HierCollectiveParams {
    fn default() -> Self {
        // SAFETY: plain integers and arrays of them: all-zero is a valid value.
        unsafe { std::mem::zeroed() }
    }
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

// ---- Proxy ring (inter-node): device producers, one host proxy thread per communicator.
// Protocol in src/transport/proxy.rs; device side in kernels/common/proxy.cuh.

/// `ProxyCommand::header` kind (low 8 bits): the slot is empty (the proxy clears it after
/// taking the command; a producer's store of a nonzero header publishes the slot).
pub const MK_PROXY_KIND_EMPTY: u32 = 0;
/// Put `bytes` from this rank's data region at `src_offset` to the peer's data region at
/// `dst_offset`, then (unless `signal_id` is `MK_PROXY_NO_SIGNAL`) write `signal_value`
/// to the peer's signal word `signal_id`, visible only after the data.
pub const MK_PROXY_KIND_PUT: u32 = 1;
/// Only the signal write of a put (no data).
pub const MK_PROXY_KIND_SIGNAL: u32 = 2;
/// `signal_id` of a put that writes no signal.
pub const MK_PROXY_NO_SIGNAL: u32 = 0xffff_ffff;
/// `ProxyCommand::header` = kind | peer << MK_PROXY_PEER_SHIFT (peer: the destination rank).
pub const MK_PROXY_PEER_SHIFT: u32 = 8;
/// Largest destination rank a header can name (24 bits).
pub const MK_PROXY_MAX_PEER: u32 = 0x00ff_ffff;

/// One 32-byte command in the proxy ring. The producer writes every field except `header`,
/// then `header` last with a release store; the proxy reads `header` with acquire, copies
/// the command out and stores 0 to `header` before freeing the slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyCommand {
    /// kind (`MK_PROXY_KIND_*`, low 8 bits) | destination rank << 8. Nonzero = published.
    pub header: u32,
    /// Bytes to move (0 for a signal-only command).
    pub bytes: u32,
    /// Offset in this rank's registered data region.
    pub src_offset: u64,
    /// Offset in the destination rank's registered data region.
    pub dst_offset: u64,
    /// Index of the destination's u64 signal word, or `MK_PROXY_NO_SIGNAL`.
    pub signal_id: u32,
    /// Value written to that signal word (epoch-valued flags: no reset between calls).
    pub signal_value: u32,
}

/// Counters the proxy writes and producers read, one cache line each so the device's
/// polling of one does not contend with the host's writes of another.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ProxyRingControl {
    /// Slots freed so far: a producer holding ticket t may write slot t % capacity once
    /// `tail + capacity > t` (back-pressure when the ring is full).
    pub tail: u64,
    pub reserved0: [u64; 7],
    /// Commands whose transfers completed, counted in ticket order: every command with a
    /// ticket below `completed` is done (its source bytes may be reused).
    pub completed: u64,
    pub reserved1: [u64; 7],
    /// 0, or the `mkResult_t` of the proxy's first failure: producers stop waiting on it.
    pub error: u32,
    pub reserved2: [u32; 15],
}

/// What a kernel needs to post commands: pointers as the device sees them, passed by value
/// inside an op's parameter struct.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ProxyRingView {
    /// `capacity` × `ProxyCommand` in host-pinned, device-mapped memory.
    pub commands: u64,
    /// `ProxyRingControl` in the same memory.
    pub control: u64,
    /// The u64 ticket counter producers claim slots from with an atomic add. It lives in
    /// device memory on a GPU (system-scope atomics on host memory over PCIe are not
    /// reliable), in host memory when host threads produce (tests).
    pub head: u64,
    /// Slots; a power of two.
    pub capacity: u32,
    pub reserved: u32,
    /// Bound on every producer wait, in nanoseconds of %globaltimer (MK_TIMEOUT_MS).
    pub timeout_ns: u64,
}

/// Parameters of the fence between fused ops of different kernels (kernels/fused_fence.cu):
/// this node's workspace and, across nodes, the node count (1: one node, the fields below
/// unused), this rank's node, its proxy ring and the rank table (as `AgGemmParams`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FusedFenceParams {
    pub ws: WorkspaceView,
    pub nodes: i32,
    pub node: i32,
    pub ring: ProxyRingView,
    pub rank_of: [i32; MK_MAX_NODE_RANKS],
}

impl Default for FusedFenceParams {
    fn default() -> Self {
        // SAFETY: plain integers and arrays of them: all-zero is a valid value.
        unsafe { std::mem::zeroed() }
    }
}

/// Parameters of the proxy test kernel (kernels/proxy.cu): every CTA's thread 0 posts
/// `commands_per_cta` puts to `peer`, each of `bytes` bytes at offsets spaced `stride`
/// apart, signalling `signal_value` on word (CTA index); the status of each CTA's last
/// post is written to `status[cta]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ProxyTestParams {
    pub ring: ProxyRingView,
    /// Device pointer to one i32 per CTA.
    pub status: u64,
    pub stride: u64,
    pub commands_per_cta: u32,
    pub bytes: u32,
    pub peer: u32,
    pub signal_value: u32,
}

/// Most signalled chunks per source rank in AllGather + GEMM (src/ops/dense/ag_gemm.rs
/// MAX_CHUNKS_PER_RANK; the kernel's flag array is sized by it).
pub const MK_AG_GEMM_MAX_CHUNKS: usize = 32;

/// Parameters of the AllGather + GEMM kernels (kernels/ag_gemm.cu). The tensor maps (A over
/// this rank's gathered buffer in the workspace, B, C) travel as separate kernel arguments.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AgGemmParams {
    pub ws: WorkspaceView,
    /// This rank's rows of A: [rows_per_rank, k].
    pub a_local: u64,
    /// Where the gathered A is also written for the caller ([m, k]), or 0.
    pub gathered_out: u64,
    /// Byte offset of the gathered A buffer ([m, k]) in every rank's data region.
    pub gathered_offset: u64,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub rows_per_rank: i32,
    pub chunk_rows: i32,
    pub chunks_per_rank: i32,
    /// CTAs 0..compute_ctas run GEMM tiles; the next comm_ctas push and signal chunks.
    pub compute_ctas: i32,
    pub comm_ctas: i32,
    pub group_m: i32,
    /// First row block computed (this rank's own rows).
    pub m_block_base: i32,
    /// Device buffer of `MK_TRACE_WORDS` u64 per CTA for `mkbench --trace`, or 0 (always,
    /// from the C API): where each CTA spent its time (kernels/common/trace.cuh).
    pub trace: u64,
    /// This rank's global rank (its rows of A start at global_rank * rows_per_rank);
    /// `ws.rank` is the local rank within the node. Equal on one node.
    pub global_rank: i32,
    /// Signal words per source rank for the chunk flags (AGG_CHUNK + src * flag_stride + c):
    /// MK_AG_GEMM_MAX_CHUNKS on one node, 256 / nranks (at most 32) across nodes.
    pub flag_stride: i32,
    /// Across nodes (kernels/ag_gemm.cu, hierarchical path): the node count (1: one node,
    /// the fields below unused), this rank's node, its proxy ring, and the rank table
    /// (rank_of[m * MK_MAX_PEERS + l]: global rank of local rank l on node m).
    pub nodes: i32,
    pub node: i32,
    pub ring: ProxyRingView,
    pub rank_of: [i32; MK_MAX_NODE_RANKS],
}

impl Default for AgGemmParams {
    fn default() -> Self {
        // SAFETY: plain integers and arrays of them: all-zero is a valid value.
        unsafe { std::mem::zeroed() }
    }
}

/// Parameters of the fp8 AllGather + GEMM kernels (kernels/ag_scaled_gemm.cu): the gather's
/// (one node; the GEMM CTAs' idle producer warps push, so `comm_ctas`, `gathered_out`,
/// `trace` and the across-node fields are 0), A's scales and how they are gathered, and B's
/// scales. The gathered scales live in the fused-op region after the gathered rows: per
/// tensor and rowwise one fp32 per gathered row (a rank's one scale written for each of its
/// rows), with block scales [K/128][m] (the GEMM's block layout over all gathered rows).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AgScaledGemmParams {
    /// The gathered e4m3 rows, as mkAllGatherGemm's (`k` one-byte elements per row).
    pub ag: AgGemmParams,
    /// This rank's scales of A: one (per tensor), rows_per_rank (rowwise) or
    /// [K/128][rows_per_rank] (block).
    pub scale_a_local: u64,
    /// B's scales, as mkScaledGemm takes them.
    pub scale_b: u64,
    /// Byte offset of the gathered scales in every rank's data region (16-byte aligned).
    pub scale_offset: u64,
    /// Step through `scale_a_local` per gathered scale: 0 (one scale for the shard: per
    /// tensor) or 1.
    pub scale_a_local_step: i32,
    /// K / 128 with block scales, else 0 (the GEMM's `scale_k_blocks`).
    pub scale_k_blocks: i32,
    /// The GEMM's `scale_b_step`: 0 per tensor, 1 rowwise (unused with block scales).
    pub scale_b_step: i32,
    pub reserved: i32,
}

/// Parameters of the GEMM + ReduceScatter / AllReduce kernels (kernels/gemm_reduce.cu). The
/// tensor maps (A, B, and this rank's partial-product buffer P in the fused-op region)
/// travel as separate kernel arguments.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemmReduceParams {
    pub ws: WorkspaceView,
    /// Output: AllReduce [m, n]; ReduceScatter this rank's rows [row_hi - row_lo, n].
    pub c: u64,
    /// Byte offset of P ([m, n] partial products) in every rank's data region.
    pub partial_offset: u64,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    /// Rows of A's tensor-map box: the tile's rows, or m where A has fewer (the engine's
    /// `GemmShape::a_box_rows`).
    pub a_box_rows: i32,
    /// Rows of the sum this rank produces: [row_lo, row_hi).
    pub row_lo: i32,
    pub row_hi: i32,
    /// Row of the sum that lands in C's row 0 (AllReduce 0, ReduceScatter row_lo).
    pub out_row0: i32,
    pub tiles_n: i32,
    pub group_m: i32,
    /// CTAs 0..compute_ctas run GEMM tiles; the next reduce_ctas sum partial tiles.
    pub compute_ctas: i32,
    pub reduce_ctas: i32,
    /// 17 ReduceScatter, 18 AllReduce (for error words).
    pub op: i32,
    /// AllReduce in two phases: each row block is reduced once, by the rank owning it
    /// (rows [r·rows_per_rank, (r+1)·rows_per_rank)), into C and into its reduced buffer R;
    /// every other rank copies it from there. 0: one-shot (every rank reduces every tile).
    pub two_phase: i32,
    /// As `AgGemmParams::trace`.
    pub trace: u64,
    /// Byte offset of R ([m, n], two-phase only) in every rank's data region.
    pub reduced_offset: u64,
    /// Rows each rank owns in the two-phase path (a multiple of 128).
    pub rows_per_rank: i32,
    /// Compute and reduction walk the row blocks of this many equal owner shards
    /// interleaved (kernels/common/gemm/scheduler.cuh OwnerInterleavedRaster); 1: in order.
    pub interleave: i32,
    /// Across nodes (src/ops/dense/gemm_reduce_nodes.rs has the plan; 1: one node, the fields
    /// below unused): `ws` is this node's workspace (indexed by local rank); global rank q
    /// owns rows [q·owner_rows, (q+1)·owner_rows) ∩ [0, m), in `owner_blocks` blocks of 128.
    pub nodes: i32,
    pub node: i32,
    pub global_rank: i32,
    pub owner_rows: i32,
    pub owner_blocks: i32,
    /// Signal words (absolute): NET_IN + m·MB + b, NET_REDUCED + m·MB + b, the element
    /// counters per (m, b) and per own block.
    pub net_in_word: u32,
    pub net_reduced_word: u32,
    pub count_node_word: u32,
    pub count_final_word: u32,
    /// Byte offsets in every rank's data region: N slabs each of [owner_rows, n], slab m at
    /// Word + m · slab_bytes. (R, for AllReduce, is at `reduced_offset`.)
    pub outbox_offset: u64,
    pub inbox_offset: u64,
    pub slab_bytes: u64,
    pub ring: ProxyRingView,
    /// rank_of[m * MK_MAX_PEERS + l]: global rank of local rank l on node m.
    pub rank_of: [i32; MK_MAX_NODE_RANKS],
    /// GEMM+RS on one node, reducers after the GEMM (`ops::dense::gemm_reduce::early_items`; the
    /// `mk_gemm_reduce_early_*` kernels only): the most of a GEMM CTA's reducer items (tiles
    /// of its walk, all but its last) that its two idle producer warps may sum during the
    /// GEMM, as the partials are flagged; the CTA's 12 warps sum the rest after it. Last in
    /// the struct, so the other kernels' parameter offsets (and code) do not depend on it.
    pub early_items: i32,
}

impl Default for GemmReduceParams {
    fn default() -> Self {
        // SAFETY: plain integers and arrays of them: all-zero is a valid value.
        unsafe { std::mem::zeroed() }
    }
}

/// Parameters of the fp8 GEMM + ReduceScatter / AllReduce kernels
/// (kernels/gemm_reduce_scaled.cu): the bf16 kernels' (one node, the GEMM CTAs or
/// MK_COMM_SMS's dedicated CTAs reducing after the GEMM: `a_box_rows`, `trace`,
/// `early_items` and the across-node fields are 0; the partials P and the sums are elements
/// of C's type), then A's and B's scales as mkScaledGemm takes them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ScaledGemmReduceParams {
    pub gr: GemmReduceParams,
    /// This rank's scales of its A [M, K_r] and B [N, K_r]: one each (per tensor), M and N
    /// (rowwise), [K_r/128][M] and [K_r/128][ceil(N/128)] (block).
    pub scale_a: u64,
    pub scale_b: u64,
    /// The scaled GEMM's steps through the scales per row: 0 per tensor, 1 rowwise (unused
    /// with block scales).
    pub scale_a_step: i32,
    pub scale_b_step: i32,
    /// K_r / 128 with block scales, else 0.
    pub scale_k_blocks: i32,
    pub reserved: i32,
}

/// u64 words per CTA in a fused kernel's trace buffer (layout in kernels/common/trace.cuh).
pub const MK_TRACE_WORDS: usize = 14;

/// Parameters of the MoE kernels (kernels/moe.cu: mkMoeDispatchGemm and mkMoeGemmCombine).
/// The tensor maps travel as separate kernel arguments: dispatch A = this rank's receive
/// buffer in the fused-op region, B = W1 as [E_local·F, H], C = Y; combine A = Y', B = W2
/// as [E_local·H, F], C = Z in the fused-op region.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MoeParams {
    pub ws: WorkspaceView,
    /// Dispatch: x [tokens, hidden].
    pub x: u64,
    /// Dispatch: topkIdx [tokens, top_k] int32.
    pub topk_idx: u64,
    /// Combine: topkWeights [tokens, top_k] fp32.
    pub topk_weights: u64,
    /// Combine: out [tokens, hidden].
    pub out: u64,
    /// Dispatch: recvCounts [experts_local + 1] int32.
    pub recv_counts: u64,
    /// The caller's layout buffer (int32 words, offsets below; ops::moe::LayoutOffsets).
    pub layout: u64,
    /// Byte offset, from `ws.data[r]`, of the count-exchange area (fused-op region start).
    pub counts_offset: u64,
    /// Byte offset, from `ws.data[r]`, of the receive buffer (dispatch) / Z (combine).
    pub buf_offset: u64,
    /// Layout word offsets: per-slot owner rank, per-slot row, per-m-block expert, m-block order, m-block source mask.
    pub lay_dest: i32,
    pub lay_row: i32,
    pub lay_mb_expert: i32,
    pub lay_mb_order: i32,
    pub lay_mb_srcmask: i32,
    /// Per m-block: first order position of its (order key, expert) run | run length << 15.
    pub lay_mb_run: i32,
    /// Per m-block: first block of its expert's segment | the segment's blocks << 15.
    pub lay_mb_seg: i32,
    /// Per m-block: its rows in use (1..=128; the rest is padding).
    pub lay_mb_rows: i32,
    /// The send list: this rank's slots grouped by (local expert, destination step).
    pub lay_send: i32,
    /// [E + 1]: first send-list entry of each list, then the total.
    pub lay_send_row0: i32,
    pub tokens: i32,
    pub hidden: i32,
    pub ffn: i32,
    pub top_k: i32,
    pub experts: i32,
    pub experts_local: i32,
    /// Rows of Y / the receive buffer (a multiple of 128).
    pub capacity: i32,
    /// Column tiles of the GEMM (F / BN for dispatch, H / BN for combine).
    pub tiles_n: i32,
    /// Column tiles per band (divides tiles_n, ops::moe::band_locate): the GEMM runs band by
    /// band and the combine's pull follows the bands (ops::moe::band_width); tiles_n = one band.
    pub band_w: i32,
    pub group_m: i32,
    /// CTAs 0..compute_ctas run GEMM tiles; the next comm_ctas send (dispatch) or pull (combine).
    pub compute_ctas: i32,
    pub comm_ctas: i32,
    /// 1: fused GEMM; 0: communication only (the benchmark's unfused baseline runs the
    /// GEMM as separate launches).
    pub gemm: i32,
    /// Dispatch: 1 = the three idle warps of every GEMM CTA's producer warpgroup send the
    /// token rows (no communication CTA: the last GEMM CTA computes the layout first);
    /// 0 = the communication CTAs compute the layout and send (MK_COMM_SMS).
    pub send_by_gemm_ctas: i32,
    /// Dispatch with `send_by_gemm_ctas`: every warp of every GEMM CTA first sends the send
    /// lists q < burst_lists (the rows of the first wave of tiles) before its GEMM starts;
    /// 0: only the side warps send (ops::moe::burst_lists, `Tuning::moe_burst`).
    pub burst_lists: i32,
    /// Dispatch: CTAs [0, prep_ctas) build the layout, prep_tokens tokens each
    /// (ops::moe::prep_split); 0 in the combine.
    pub prep_ctas: i32,
    pub prep_tokens: i32,
    /// Dispatch: 0 = no-drop mode; c > 0 = drop mode, each rank keeps the first c of its
    /// rows of each expert in token order (ops::moe::kept).
    pub expert_capacity: i32,
    /// Dispatch: [E] int32, this rank's dropped rows per expert (0 in no-drop mode); 0 = none.
    pub drop_counts: u64,
    /// As `AgGemmParams::trace`.
    pub trace: u64,
    /// Dispatch, the gated kernels (`dispatch_gated`): 1 = SiLU (SwiGLU), 2 = GELU, erf form
    /// (GeGLU) applied to the gate half of w1 (ops::moe::Activation); unread by the others.
    pub activation: i32,
}

/// Parameters of the ring-attention kernels (kernels/ring_attention.cu). Tensors as the
/// mkRingAttention header states: q/out [batch, seq_local, heads, D], k/v [batch,
/// seq_local, kv_heads, D], lse [batch, heads, seq_local] fp32.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RingAttnParams {
    /// The communicator's workspace (ring mode); unused in gathered mode or at one rank.
    pub ws: WorkspaceView,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub lse: u64,
    /// Byte offset, in every rank's data region, of that rank's K copy; V follows it at
    /// `kv_elems` elements.
    pub kv_offset: u64,
    /// Elements of one rank's K (= of its V): batch · seq_local · kv_heads · D.
    pub kv_elems: u64,
    /// Gathered mode when nonzero: source rank s's K at `kv_gathered + s · kv_elems`
    /// elements (V likewise in `v_gathered`), all local; no signals.
    pub kv_gathered: u64,
    pub v_gathered: u64,
    pub batch: i32,
    pub seq_local: i32,
    pub heads: i32,
    pub kv_heads: i32,
    /// 1: causal mask over global positions (zigzag layout); 0: none (contiguous shards).
    pub causal: i32,
    /// Ring size and this rank's place in it (positions and step sources follow them).
    pub nranks: i32,
    pub rank: i32,
    /// Query blocks (of 128) per (batch, head); work items = batch · heads · q_blocks.
    pub q_blocks: i32,
    pub num_items: i32,
    /// softmaxScale · log2(e): scores go through exp2.
    pub scale_log2: f32,
    /// Nonzero: work items are handed out at run time, in the section order of
    /// ops::attention::ring_attention::sched_item, from a counter in this rank's signal region
    /// (`ws.signals[ws.rank]`, which must then be set, also at one rank); 0: each CTA
    /// walks its fixed snake of items (gathered mode, no workspace).
    pub sched_dynamic: i32,
    /// (batch, head) pairs per section of the dynamic order (a multiple of heads /
    /// kv_heads, ≥ 1): ops::attention::ring_attention::sched_section.
    pub sched_section: i32,
}

/// Parameters of the ring-attention backward kernels (kernels/ring_attention_backward.cu).
/// Tensors as the mkRingAttentionBackward header states: q/out/dout/dq [batch, seq_local,
/// heads, D], k/v/dk/dv [batch, seq_local, kv_heads, D], lse [batch, heads, seq_local]
/// fp32. The fused-op region of every rank holds, from `kv_offset`: its K and V copy
/// (more than one rank), the rows' (lse·log2 e, delta) at `rows_offset` (own use), and
/// the dK/dV accumulator slots at `slots_offset` (read by the ring predecessor):
/// ops::attention::ring_attention_backward::WorkspaceLayout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RingAttnBwdParams {
    pub ws: WorkspaceView,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub dout: u64,
    pub lse: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    /// Byte offsets in every rank's fused-op region (absolute, from the region's base in
    /// `ws.data`): the K copy (V follows it at `kv_elems` elements), the row values, the
    /// dK/dV slots; the one-pass engine's dQ sums (fp32) and their turn words (u64).
    pub kv_offset: u64,
    pub rows_offset: u64,
    pub slots_offset: u64,
    pub dq_sums_offset: u64,
    pub dq_turns_offset: u64,
    /// Elements of one rank's K (= of its V): batch · seq_local · kv_heads · D.
    pub kv_elems: u64,
    pub batch: i32,
    pub seq_local: i32,
    pub heads: i32,
    pub kv_heads: i32,
    /// 1: causal mask over global positions (zigzag layout); 0: none (contiguous shards).
    pub causal: i32,
    pub nranks: i32,
    pub rank: i32,
    /// 64-token query tiles per (batch, head); the row values are padded to q_tiles · 64
    /// per (batch, head).
    pub q_tiles: i32,
    /// 128-query dQ items per (batch, head).
    pub q_blocks: i32,
    /// 128-key dK/dV items per (batch, kv head) and per ring step: batch · kv_heads · k_blocks.
    pub k_blocks: i32,
    pub kv_items: i32,
    /// Tickets of one call: nranks · kv_items dK/dV items, then batch · heads · q_blocks dQ items
    /// (none in the one-pass engine).
    pub num_tickets: i32,
    /// One-pass engine: 1 = dQ's partials are added to the sums in any order (atomic adds);
    /// 0 = in each query tile's turn order (bitwise reproducible).
    pub dq_atomic: i32,
    /// softmaxScale, and softmaxScale · log2(e) (scores go through exp2).
    pub scale: f32,
    pub scale_log2: f32,
}

// ---- Signal region (u64 words; 2 MiB per rank, zeroed at init by src/comm/workspace.rs) ----
// Flags are epoch-valued (they only grow), so nothing is reset between calls; counters are
// zero between launches (the last arrival resets them). Each fused op owns a disjoint range,
// so one op's flags can never satisfy another op's wait.

/// Nonzero: a kernel raised the abort (1 + its rank within the node; waits test only nonzero).
pub const MK_SIG_ABORT: u32 = 0;
/// Nonzero: the first error word a kernel of this rank recorded (a 32-bit CAS on its low half).
pub const MK_SIG_ERROR_CLAIM: u32 = 1;
/// Fences between fused ops of different kernels (kernels/fused_fence.cu) this rank completed.
pub const MK_SIG_FENCE_SEQ: u32 = 2;
/// Word + src, written by src: src reached its fence k (so it has finished every fused op
/// before it, and reads and writes no rank's fused-op region for them any more).
pub const MK_SIG_FENCE_DONE: u32 = 8;
/// Word + m, written (through the proxy) by the rank of node m with this rank's local rank:
/// it and every rank of its node reached fence k (the node-crossing half of
/// MK_SIG_FENCE_DONE).
pub const MK_SIG_FENCE_NET_DONE: u32 = MK_SIG_FENCE_DONE + MK_MAX_PEERS as u32;
const _: () = assert!(MK_SIG_FENCE_NET_DONE + MK_MAX_NODES as u32 <= MK_SIG_SEQ);
/// Word + b: last step of collective CTA b (its own rank only).
pub const MK_SIG_SEQ: u32 = 64;
/// Collective CTA slots with flags.
pub const MK_SIG_MAX_CTAS: u32 = 256;
/// Word + b * MK_MAX_PEERS + src: src's piece of step s is staged (collectives).
pub const MK_SIG_READY: u32 = 512;
/// AllReduce: src's reduced slice is ready.
pub const MK_SIG_READY2: u32 = MK_SIG_READY + MK_SIG_MAX_CTAS * MK_MAX_PEERS as u32;
/// src finished reading this rank's slot of step s.
pub const MK_SIG_FREE: u32 = MK_SIG_READY2 + MK_SIG_MAX_CTAS * MK_MAX_PEERS as u32;
/// CTA slots with network flags (hierarchical collectives).
pub const MK_SIG_NET_CTAS: u32 = 64;
/// Across nodes (kernels/hier_collectives.cu), + b * MK_MAX_NODES + src_node, written by the
/// proxy of src_node's GPU-i rank: src_node may put step s into this rank's slot.
pub const MK_SIG_NET_GRANT: u32 = 6656;
/// src_node's data of step s has arrived.
pub const MK_SIG_NET_READY: u32 = MK_SIG_NET_GRANT + MK_SIG_NET_CTAS * MK_MAX_NODES as u32;
/// AllReduce: src_node's reduced slice has arrived.
pub const MK_SIG_NET_READY2: u32 = MK_SIG_NET_READY + MK_SIG_NET_CTAS * MK_MAX_NODES as u32;
/// Words from here to MK_SIG_WORDS belong to the fused ops: AllGather + GEMM
/// [OP_BASE, +1024), GEMM + reduction [OP_BASE + 1024, MK_SIG_GR_END), MoE
/// [MK_SIG_MOE_BASE, +65536), ring attention [MK_SIG_RING_BASE, +65536).
pub const MK_SIG_OP_BASE: u32 = 8192;
/// End of the GEMM + reduction range (its per-tile flags fill the rest of the first MiB).
pub const MK_SIG_GR_END: u32 = 131072;
pub const MK_SIG_MOE_BASE: u32 = 131072;
pub const MK_SIG_RING_BASE: u32 = 196608;
/// Words of the signal region (2 MiB).
pub const MK_SIG_WORDS: u32 = 262144;

// AllGather + GEMM (kernels/ag_gemm.cu), own region unless noted.
/// Last completed epoch of this rank.
pub const AGG_EPOCH: u32 = MK_SIG_OP_BASE;
/// CTAs of the running launch that have finished (counter).
pub const AGG_ARRIVE: u32 = MK_SIG_OP_BASE + 1;
/// CTAs of the running launch that copied their slice of the own rows (counter).
pub const AGG_LOCAL: u32 = MK_SIG_OP_BASE + 2;
/// Word + q: local rank q finished epoch e (written by q).
pub const AGG_DONE: u32 = MK_SIG_OP_BASE + 8;
/// Word + node m: node m's GPU-l rank finished epoch e (written by its proxy).
pub const AGG_NET_DONE: u32 = MK_SIG_OP_BASE + 16;
/// Word + src * flag_stride + c: chunk c of global rank src arrived.
pub const AGG_CHUNK: u32 = MK_SIG_OP_BASE + 64;
/// Word + q * MK_AG_GEMM_MAX_CHUNKS + c (one node) or + (q * nodes + m) * flag_stride + c (across
/// nodes): pushers done with chunk c (of source node m) for local rank q (counter, reset by
/// the last).
pub const AGG_PUSHED: u32 = AGG_CHUNK + MK_MAX_PEERS as u32 * MK_AG_GEMM_MAX_CHUNKS as u32;
/// End of the words AllGather + GEMM uses.
pub const AGG_WORDS_END: u32 = AGG_PUSHED + MK_MAX_PEERS as u32 * MK_AG_GEMM_MAX_CHUNKS as u32;
const _: () = assert!(AGG_WORDS_END <= MK_SIG_OP_BASE + 1024, "AG+GEMM owns 1024 signal words");
const _: () = assert!(
    MK_SIG_FREE + MK_SIG_MAX_CTAS * MK_MAX_PEERS as u32 <= MK_SIG_NET_GRANT,
    "one-node flags end where the network flags begin"
);
const _: () = assert!(
    MK_SIG_NET_READY2 + MK_SIG_NET_CTAS * MK_MAX_NODES as u32 <= MK_SIG_OP_BASE,
    "network flags end at the fused ops' base"
);
const _: () = assert!(GR_TILE < MK_SIG_GR_END && MK_SIG_GR_END <= MK_SIG_MOE_BASE && MOE_END <= MK_SIG_RING_BASE);
const _: () = assert!(MK_SIG_RING_BASE + 65536 <= MK_SIG_WORDS);

// GEMM + ReduceScatter / AllReduce (kernels/gemm_reduce*.cu).
pub const GR_EPOCH: u32 = MK_SIG_OP_BASE + 1024;
pub const GR_ARRIVE: u32 = MK_SIG_OP_BASE + 1025;
/// Word + q: rank q finished reading this rank's P of epoch e.
pub const GR_DONE: u32 = MK_SIG_OP_BASE + 1032;
/// Across nodes, + m: node m's GPU-l rank is done with its inbox and R of epoch e (this rank
/// may put the next call's data there); written by that rank's proxy.
pub const GR_NET_DONE: u32 = MK_SIG_OP_BASE + 1040;
/// Across nodes: element counters, [GR_COUNT, GR_TILE): a range of their own, because a
/// counter must start at 0 and the words past the tile flags hold other shapes' epochs.
pub const GR_COUNT: u32 = MK_SIG_OP_BASE + 1056;
/// Word + tile * 2 + slab: slab stored (own region). Two-phase AllReduce: GR_TILE + 2 * tiles +
/// tile: the owner reduced the tile into its R. Across nodes the network flags follow.
pub const GR_TILE: u32 = MK_SIG_OP_BASE + 2048;

// MoE (kernels/moe.cu), own region unless noted, all in [MK_SIG_MOE_BASE, +65536).
pub const MOE_EPOCH: u32 = MK_SIG_MOE_BASE;
pub const MOE_ARRIVE: u32 = MK_SIG_MOE_BASE + 1;
/// The prep CTAs wrote the layout of epoch e (the last of them raises it).
pub const MOE_PREP: u32 = MK_SIG_MOE_BASE + 2;
/// The prep CTAs' arrivals at each of their barriers (counter; the last resets it).
pub const MOE_PREP_ARRIVE: u32 = MK_SIG_MOE_BASE + 3;
/// Every prep CTA wrote its per-expert counts of epoch e.
pub const MOE_PREP_COUNTED: u32 = MK_SIG_MOE_BASE + 4;
/// The counts' prefixes over the prep CTAs and their totals of epoch e are written.
pub const MOE_PREP_SCANNED: u32 = MK_SIG_MOE_BASE + 5;
/// Prep CTA 0 wrote this rank's offsets, the send lists' starts and the overflow word of epoch e.
pub const MOE_PREP_OFFSETS: u32 = MK_SIG_MOE_BASE + 6;
/// How far this rank's dispatch prep got, written by prep CTA 0: epoch · 16 + one of the
/// MOE_STEP_* below (timed_out_wait.rs names them). A peer whose wait for this rank's flag
/// times out records it beside the flag, which tells a kernel that had not started from one
/// whose prep stopped at a step.
pub const MOE_PROGRESS: u32 = MK_SIG_MOE_BASE + 7;
/// The steps of MOE_PROGRESS, in order.
pub const MOE_STEP_BEGUN: u32 = 1;
pub const MOE_STEP_COUNTED: u32 = 2;
pub const MOE_STEP_SCANNED: u32 = 3;
pub const MOE_STEP_PEERS_DONE: u32 = 4;
pub const MOE_STEP_COUNTS_SENT: u32 = 5;
pub const MOE_STEP_COUNTS_IN: u32 = 6;
pub const MOE_STEP_LAYOUT: u32 = 7;
/// Word + q: rank q finished MoE kernel e (written by q).
pub const MOE_DONE: u32 = MK_SIG_MOE_BASE + 8;
/// Word + s: rank s wrote its counts here (written by s).
pub const MOE_CNT: u32 = MK_SIG_MOE_BASE + 16;
/// Senders' next chunk of the send list (counter).
pub const MOE_GRAB: u32 = MK_SIG_MOE_BASE + 40;
/// Sender warps done (counter; the last resets both).
pub const MOE_EXIT: u32 = MK_SIG_MOE_BASE + 41;
/// Combine: pullers' next chunk of items (counter).
pub const MOE_PULL_GRAB: u32 = MK_SIG_MOE_BASE + 42;
/// Combine: pulling warps done (counter; the last resets both).
pub const MOE_PULL_EXIT: u32 = MK_SIG_MOE_BASE + 43;
/// The GEMM's dynamic tile schedule (both kernels): the next ticket, i.e. tile in the
/// schedule's order (counter, zero between launches).
pub const MOE_TILE_NEXT: u32 = MK_SIG_MOE_BASE + 44;
/// GEMM CTAs of the running launch that took their last ticket (counter; the last resets both).
pub const MOE_TILE_EXIT: u32 = MK_SIG_MOE_BASE + 45;
/// Word + s * E_local + le: all of rank s's rows of local expert le arrived (written by s).
pub const MOE_RECV: u32 = MK_SIG_MOE_BASE + 1024;
const _: () = assert!(MOE_CNT + MK_MAX_PEERS as u32 <= MOE_GRAB && MOE_TILE_EXIT < MOE_RECV);
/// Word + q: rows of send list q copied (counter; the last copier resets it).
pub const MOE_SENT: u32 = MK_SIG_MOE_BASE + 2048;
/// Word + (m_block * tiles_n + n) * 2 + slab: Z slab stored.
pub const MOE_TILE: u32 = MK_SIG_MOE_BASE + 3072;
/// End of the MoE range.
pub const MOE_END: u32 = MK_SIG_MOE_BASE + 65536;
/// Most experts a MoE call routes to (E).
pub const MOE_MAX_EXPERTS: i32 = 1024;
/// Warps of a MoE CTA that work on the prep and the sends (the GEMM's consumer warpgroups
/// and its producer warpgroup).
pub const MOE_WARPS: i32 = 12;
/// Layout buffer word (int32): m-blocks of this rank's receive buffer in use
/// (ops::moe::LayoutOffsets holds the rest of the layout).
pub const MOE_LAY_TOTAL_MB: i32 = 0;
/// Layout buffer word: nonzero when some rank's receive buffer is too small (nothing was moved).
pub const MOE_LAY_OVERFLOW: i32 = 1;

// Ring attention (kernels/ring_attention.cu), own region unless noted.
/// Last completed epoch of this rank.
pub const RING_EPOCH: u32 = MK_SIG_RING_BASE;
/// CTAs of the running launch that have finished.
pub const RING_ARRIVE: u32 = MK_SIG_RING_BASE + 1;
/// CTAs of the running launch that copied their K/V slice.
pub const RING_COPIED: u32 = MK_SIG_RING_BASE + 2;
/// Dynamic schedule: tickets taken in the running launch.
pub const RING_SCHED_NEXT: u32 = MK_SIG_RING_BASE + 3;
/// Dynamic schedule: CTAs of the running launch that took their last.
pub const RING_SCHED_DONE: u32 = MK_SIG_RING_BASE + 4;
/// Word + q: rank q finished reading this rank's K/V of epoch e.
pub const RING_DONE: u32 = MK_SIG_RING_BASE + 8;
/// Word + src: src's K/V of epoch e is in its workspace (written by src).
pub const RING_KV: u32 = MK_SIG_RING_BASE + 16;

// Ring attention backward (kernels/ring_attention_backward.cu): the upper half of the ring
// range, own region unless noted.
pub const RING_BWD_BASE: u32 = MK_SIG_RING_BASE + 32768;
/// Last completed epoch of this rank.
pub const RING_BWD_EPOCH: u32 = RING_BWD_BASE;
/// CTAs of the running launch that have finished.
pub const RING_BWD_ARRIVE: u32 = RING_BWD_BASE + 1;
/// CTAs of the running launch that copied their K/V slice.
pub const RING_BWD_COPIED: u32 = RING_BWD_BASE + 2;
/// Dynamic schedule: tickets taken in the running launch.
pub const RING_BWD_SCHED_NEXT: u32 = RING_BWD_BASE + 3;
/// Dynamic schedule: CTAs of the running launch that took their last.
pub const RING_BWD_SCHED_DONE: u32 = RING_BWD_BASE + 4;
/// CTAs of the running launch that wrote their share of the row values (counter).
pub const RING_BWD_ROWS_ARRIVE: u32 = RING_BWD_BASE + 5;
/// Every row value of epoch e is written (the last arrival raises it).
pub const RING_BWD_ROWS_READY: u32 = RING_BWD_BASE + 6;
/// Word + q: rank q finished reading this rank's K/V and dK/dV slots of epoch e.
pub const RING_BWD_DONE: u32 = RING_BWD_BASE + 8;
/// One-pass engine: CTAs of the running launch whose dQ writer is done (counter).
pub const RING_BWD_DQ_ARRIVE: u32 = RING_BWD_BASE + 24;
/// One-pass engine: every dQ partial of epoch e is summed (the last arrival raises it).
pub const RING_BWD_DQ_READY: u32 = RING_BWD_BASE + 25;
/// Word + src: src's K/V of epoch e is in its workspace (written by src).
pub const RING_BWD_KV: u32 = RING_BWD_BASE + 16;
/// Word + item: the ring successor (rank + 1) stored its dK/dV accumulator of the item
/// for ring step s of epoch e: value (e − 1) · nranks + s + 1 (written by that rank).
pub const RING_BWD_CHAIN: u32 = RING_BWD_BASE + 64;
/// Most dK/dV items per ring step with more than one rank (one chain word each).
pub const RING_BWD_MAX_ITEMS: u32 = MK_SIG_RING_BASE + 65536 - RING_BWD_CHAIN;
const _: () =
    assert!(RING_KV + MK_MAX_PEERS as u32 <= RING_BWD_BASE && RING_BWD_KV + MK_MAX_PEERS as u32 <= RING_BWD_DQ_ARRIVE);
const _: () = assert!(RING_BWD_DQ_READY < RING_BWD_CHAIN);

// ---- Error words: bits 0-7 mkResult_t, 8-15 peer rank (0xff: none), 16-23 what was
// awaited (`MkWait`), 24-31 the op (`MkOp`). Decoded by ops::collectives::ErrorWord.

/// The operation an error word names (bits 24-31). Collectives from 1, fused ops from 16.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MkOp {
    AllGather = 1,
    ReduceScatter = 2,
    AllReduce = 3,
    AllGatherGemm = 16,
    GemmReduceScatter = 17,
    GemmAllReduce = 18,
    MoeDispatch = 19,
    MoeCombine = 20,
    RingAttention = 21,
    RingAttentionBackward = 22,
    /// The fence a communicator runs between two fused ops of different kernels.
    FusedFence = 23,
    AllGatherScaledGemm = 24,
    ScaledGemmReduceScatter = 25,
    ScaledGemmAllReduce = 26,
}

/// Every op, for decoding (a free item: cbindgen would emit an associated constant).
const MK_OPS: [MkOp; 14] = [
    MkOp::AllGather,
    MkOp::ReduceScatter,
    MkOp::AllReduce,
    MkOp::AllGatherGemm,
    MkOp::GemmReduceScatter,
    MkOp::GemmAllReduce,
    MkOp::MoeDispatch,
    MkOp::MoeCombine,
    MkOp::RingAttention,
    MkOp::RingAttentionBackward,
    MkOp::FusedFence,
    MkOp::AllGatherScaledGemm,
    MkOp::ScaledGemmReduceScatter,
    MkOp::ScaledGemmAllReduce,
];

impl MkOp {
    pub fn from_u32(v: u32) -> Option<MkOp> {
        MK_OPS.into_iter().find(|op| *op as u32 == v)
    }
    /// The C entry point that runs this op.
    pub fn api_name(self) -> &'static str {
        match self {
            MkOp::AllGather => "mkAllGather",
            MkOp::ReduceScatter => "mkReduceScatter",
            MkOp::AllReduce => "mkAllReduce",
            MkOp::AllGatherGemm => "mkAllGatherGemm",
            MkOp::GemmReduceScatter => "mkGemmReduceScatter",
            MkOp::GemmAllReduce => "mkGemmAllReduce",
            MkOp::MoeDispatch => "mkMoeDispatchGemm",
            MkOp::MoeCombine => "mkMoeGemmCombine",
            MkOp::RingAttention => "mkRingAttention",
            MkOp::RingAttentionBackward => "mkRingAttentionBackward",
            MkOp::FusedFence => "the fence between fused ops",
            MkOp::AllGatherScaledGemm => "mkAllGatherScaledGemm",
            MkOp::ScaledGemmReduceScatter => "mkScaledGemmReduceScatter",
            MkOp::ScaledGemmAllReduce => "mkScaledGemmAllReduce",
        }
    }
}

/// What a failed wait was waiting for (bits 16-23 of an error word).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MkWait {
    /// A peer's staged data.
    Ready = 1,
    /// A peer's reduced slice.
    Ready2 = 2,
    /// A peer to finish reading this rank's slot.
    Free = 3,
    /// A fused op's own flag.
    OpFlag = 4,
    /// Not a wait: an expert id outside [-1, E) (MoE input check). (5 is unused: a MoE
    /// receive buffer too small is the call's outcome, not an error word.)
    MoeExpert = 6,
    /// A rank on another node's data (through its proxy).
    Net = 7,
    /// A rank on another node to free its slot for this rank's put.
    Grant = 8,
    /// This rank's proxy (ring full, a put not completing, or the transport failed).
    Proxy = 9,
}

const MK_WAITS: [MkWait; 8] = [
    MkWait::Ready,
    MkWait::Ready2,
    MkWait::Free,
    MkWait::OpFlag,
    MkWait::MoeExpert,
    MkWait::Net,
    MkWait::Grant,
    MkWait::Proxy,
];

impl MkWait {
    pub fn from_u32(v: u32) -> Option<MkWait> {
        MK_WAITS.into_iter().find(|w| *w as u32 == v)
    }
}
