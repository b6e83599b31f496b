//! Ring attention backward (context parallel): the argument rules, the plan (pure and
//! CPU-tested) and the launch of kernels/ring_attention_backward.cu, which follows it: the
//! ring step sources of the dK/dV items and the chain their accumulators travel along,
//! the causal visibility of query tiles and key tiles, the ticket order and the layout of
//! the workspace. Layouts of the tensors are the forward's (`ops::attention::ring_attention`).
//!
//! dK/dV. At ring step s (0 ≤ s < n) rank r computes, from its own queries, the partial
//! gradient of the K/V block that started on rank (r + s + 1) mod n (its own at s = n − 1)
//! and adds it to the sum the block's previous holder, rank r + 1, formed at step s − 1.
//! So the sum of block b's gradient runs over ranks b − 1, b − 2, …, b (mod n) in that
//! order and ends at its owner, which writes dk/dv.
//!
//! dQ, by the engine `Tuning::ring_bwd_engine` chooses. Two-pass: dQ items after the dK/dV
//! items accumulate dQ in registers over every ring step (sources r, r − 1, …) and store it
//! once. One-pass (docs/decisions/0071-one-pass-attention-backward.md): the dK/dV items
//! also form dQ's partial per 64-query tile, which the kernel sums per tile in the
//! workspace, in ticket order (`dq_turn`) or, one-pass-atomic, in any order.

use crate::comm::Comm;
use crate::cuda::kernels::{self, Arg, Kernel};
use crate::cuda::memo::Memo;
use crate::cuda::sys;
use crate::error::{MkError, Result};
use crate::kernel_abi::{RingAttnBwdParams, MK_MAX_PEERS, RING_BWD_MAX_ITEMS};
use crate::ops::attention::ring_attention::{token_pos, RingArgs, RingShape};
use crate::ops::attention::TILE_ELEMENT_BYTES;
use crate::ops::common::fused_fence::{self, FusedKernel};
use crate::ops::common::launch::{DeviceCaps, KernelLaunch};
use crate::tuning::RingBackwardEngine;
use crate::types::{mkDataType_t, Element, RawDataType};
use std::ffi::c_void;
use std::sync::Arc;

/// Rows of an item's X tiles (the kernel's BX: 128 keys of a dK/dV item, 128 queries of a
/// dQ item, 64 per consumer warpgroup) and of a streamed Y tile (BY).
pub const BLOCK_X: usize = 128;
pub const BLOCK_Y: usize = 64;
/// Threads per CTA: two math warpgroups and one loading warpgroup.
pub const THREADS: u32 = 384;
/// Slots of the kernel's X ring (pairs of 128-row tiles; one in the one-pass engine, whose
/// items are long) and of its Y ring.
pub const X_STAGES: usize = 2;
pub const ONE_PASS_X_STAGES: usize = 1;
pub const Y_STAGES: usize = 2;
/// One-pass: slots of dQ partials (BLOCK_Y × head_dim fp32) between the math warps and the
/// dQ writer.
pub const DQ_STAGES: usize = 2;

/// Dynamic shared memory of the kernel (ring_attention_backward.cu smem_bytes): the X
/// ring's pairs of X tiles, Y_STAGES pairs of Y tiles, their 64 row values each (8 bytes),
/// one-pass also two dS tiles (BLOCK_X × BLOCK_Y, 16-bit) and DQ_STAGES dQ partials, and
/// 1 KiB to align to the 128-byte swizzle's period. The kernel traps when given less.
pub fn smem_bytes(engine: RingBackwardEngine, head_dim: usize) -> usize {
    let one_pass = engine != RingBackwardEngine::TwoPass;
    let x_stages = if one_pass { ONE_PASS_X_STAGES } else { X_STAGES };
    let tile = |rows: usize| rows * head_dim * TILE_ELEMENT_BYTES;
    let dq = if one_pass { 2 * BLOCK_X * BLOCK_Y * TILE_ELEMENT_BYTES + DQ_STAGES * BLOCK_Y * head_dim * 4 } else { 0 };
    x_stages * 2 * tile(BLOCK_X) + Y_STAGES * 2 * tile(BLOCK_Y) + Y_STAGES * BLOCK_Y * 8 + dq + 1024
}

/// The rank whose K/V block rank `rank` works on at dK/dV ring step `step`: (rank + step +
/// 1) mod n, its own at the last step.
pub fn kv_step_source(rank: usize, step: usize, n: usize) -> usize {
    (rank + step + 1) % n
}

/// The ranks whose partials make block `owner`'s dK/dV, in the order they are summed (the
/// chain its accumulator travels along): ring step s is rank (owner − s − 1) mod n, which
/// reads the sum of step s − 1 from rank + 1.
pub fn chain_order(owner: usize, n: usize) -> Vec<usize> {
    (0..n).map(|s| (owner + n - (s + 1) % n) % n).collect()
}

/// How many of `rank`'s local tokens lie at global positions below `pos`: a prefix of the
/// local index, since positions grow with it (the kernel's tokens_before).
pub fn tokens_before(s: &RingShape, rank: usize, pos: usize) -> usize {
    let clamp = |start: usize, len: usize| pos.saturating_sub(start).min(len);
    if s.causal {
        let half = s.seq_local / 2;
        clamp(rank * half, half) + clamp((2 * s.nranks - 1 - rank) * half, s.seq_local - half)
    } else {
        clamp(rank * s.seq_local, s.seq_local)
    }
}

/// The query tiles (of BLOCK_Y local queries of `rank`) that key block `block` (BLOCK_X keys)
/// of `src` must meet: from the first that holds a query at or after the block's first
/// key, to the last. Causal blocks that no query of `rank` sees give an empty range.
pub fn query_tiles(s: &RingShape, rank: usize, src: usize, block: usize) -> std::ops::Range<usize> {
    let q_tiles = s.seq_local.div_ceil(BLOCK_Y);
    let first = if s.causal { tokens_before(s, rank, token_pos(s, src, block * BLOCK_X)) / BLOCK_Y } else { 0 };
    first.min(q_tiles)..q_tiles
}

/// The key tiles (of BLOCK_Y keys of `src`) that query block `block` (BLOCK_X local queries
/// of `rank`) must meet: a prefix, up to the last key at or before its last query.
pub fn key_tiles(s: &RingShape, rank: usize, src: usize, block: usize) -> usize {
    let last = (block * BLOCK_X + BLOCK_X).min(s.seq_local) - 1;
    let count = if s.causal { tokens_before(s, src, token_pos(s, rank, last) + 1) } else { s.seq_local };
    count.div_ceil(BLOCK_Y)
}

/// One-pass: how many key blocks of `src` have a dK/dV item whose walk takes query tile `m`
/// of `rank` (the kernel's dq_key_blocks): a prefix of the blocks, those whose
/// `query_tiles` contain m.
pub fn dq_key_blocks(s: &RingShape, rank: usize, src: usize, m: usize) -> usize {
    let k_blocks = s.seq_local.div_ceil(BLOCK_X);
    let last = (m + 1) * BLOCK_Y;
    if !s.causal || last > s.seq_local {
        return k_blocks;
    }
    tokens_before(s, src, token_pos(s, rank, last - 1) + 1).div_ceil(BLOCK_X)
}

/// One-pass: the number of dQ partials summed into query tile `m` of `rank` before the one
/// of the dK/dV item at ring step `step`, key block `block` (the kernel's dq_turn). A tile's
/// partials are summed in ticket order (step, then block), so the sum's order is fixed and
/// no partial waits for a later ticket: while every rank's grid is resident, the earliest
/// unfinished ticket never waits.
pub fn dq_turn(s: &RingShape, rank: usize, m: usize, step: usize, block: usize) -> usize {
    (0..step).map(|a| dq_key_blocks(s, rank, kv_step_source(rank, a, s.nranks), m)).sum::<usize>() + block
}

/// What a ticket stands for (the kernel's Task).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ticket {
    /// dK/dV of key block `block` of (batch, kv_head) at ring step `step`; `index` numbers
    /// the blocks of one step (the chain word and slot).
    KeyBlock { step: usize, index: usize, batch: usize, kv_head: usize, block: usize },
    /// dQ of query block `block` of (batch, head).
    QueryBlock { batch: usize, head: usize, block: usize },
}

/// The launch plan of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingAttentionBackwardPlan {
    pub q_tiles: usize,
    pub q_blocks: usize,
    pub k_blocks: usize,
    /// dK/dV items of one ring step: batch · kv_heads · k_blocks.
    pub kv_items: usize,
    /// nranks · kv_items dK/dV tickets, then (two-pass) batch · heads · q_blocks dQ tickets.
    pub tickets: usize,
    pub grid: u32,
    pub smem_bytes: usize,
    pub head_dim: usize,
    pub engine: RingBackwardEngine,
}

/// The plan with this process's engine (MK_INTERNAL_RING_BWD_ENGINE, read once); one-pass
/// when it is `auto`, as a call whose workspace holds the dQ sums takes it.
pub fn plan(s: &RingShape, grid_cap: u32) -> RingAttentionBackwardPlan {
    plan_for(s, grid_cap, crate::tuning::Tuning::process().ring_bwd_engine.unwrap_or(RingBackwardEngine::OnePass))
}

/// A call's engine: the tuning's when set; else one-pass when the workspace's fused-op region
/// (`op_bytes`) holds one-pass's layout, dQ sums included, and two-pass otherwise. Both are
/// bitwise reproducible, and the choice depends only on the shape, the element type and the
/// workspace size, which every rank has alike, so every rank takes the same engine.
pub fn choose_engine(
    tuned: Option<RingBackwardEngine>,
    s: &RingShape,
    grid_cap: u32,
    dtype: impl Element,
    op_bytes: u64,
) -> RingBackwardEngine {
    tuned.unwrap_or_else(|| {
        let one_pass = plan_for(s, grid_cap, RingBackwardEngine::OnePass);
        if workspace_layout(s, &one_pass, dtype).bytes <= op_bytes {
            RingBackwardEngine::OnePass
        } else {
            RingBackwardEngine::TwoPass
        }
    })
}

pub fn plan_for(s: &RingShape, grid_cap: u32, engine: RingBackwardEngine) -> RingAttentionBackwardPlan {
    let q_tiles = s.seq_local.div_ceil(BLOCK_Y);
    let q_blocks = s.seq_local.div_ceil(BLOCK_X);
    let k_blocks = s.seq_local.div_ceil(BLOCK_X);
    let kv_items = s.batch * s.kv_heads * k_blocks;
    let dq_items = if engine == RingBackwardEngine::TwoPass { s.batch * s.heads * q_blocks } else { 0 };
    let tickets = s.nranks * kv_items + dq_items;
    RingAttentionBackwardPlan {
        q_tiles,
        q_blocks,
        k_blocks,
        kv_items,
        tickets,
        grid: (tickets as u32).clamp(1, grid_cap.max(1)),
        smem_bytes: smem_bytes(engine, s.head_dim),
        head_dim: s.head_dim,
        engine,
    }
}

impl RingAttentionBackwardPlan {
    /// Ticket `i` (< tickets): dK/dV items step by step, then dQ items, each (batch, head)'s
    /// heaviest query block first (causal: later local queries see more keys).
    pub fn ticket(&self, s: &RingShape, i: usize) -> Ticket {
        if i < s.nranks * self.kv_items {
            let (step, index) = (i / self.kv_items, i % self.kv_items);
            Ticket::KeyBlock {
                step,
                index,
                batch: index / (self.k_blocks * s.kv_heads),
                kv_head: index / self.k_blocks % s.kv_heads,
                block: index % self.k_blocks,
            }
        } else {
            let j = i - s.nranks * self.kv_items;
            let bh = j / self.q_blocks;
            Ticket::QueryBlock { batch: bh / s.heads, head: bh % s.heads, block: self.q_blocks - 1 - j % self.q_blocks }
        }
    }

    pub fn kernel_launch(&self, dtype: impl Element) -> Result<KernelLaunch> {
        let kernel = kernel_for(self.engine, dtype, self.head_dim)?;
        Ok(KernelLaunch::new(kernel, self.grid, THREADS, self.smem_bytes as u32))
    }
}

/// Where the backward's data lie in every rank's fused-op region (byte offsets from the
/// region's start): its K and V copy (more than one rank), the per-query row values (lse ·
/// log2 e, delta) of this rank (8 bytes per query, q_tiles · 64 per (batch, head)), the
/// dK/dV slots (fp32, one per dK/dV item of each ring step but the last), for K and V of
/// elements of `dtype`, and, one-pass, the dQ sums (fp32, BLOCK_Y × head_dim per query
/// tile) and one u64 turn word per tile (empty, at `bytes`, for two-pass).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspaceLayout {
    pub kv: u64,
    pub rows: u64,
    pub slots: u64,
    pub dq_sums: u64,
    pub dq_turns: u64,
    pub bytes: u64,
}

pub fn workspace_layout(s: &RingShape, plan: &RingAttentionBackwardPlan, dtype: impl Element) -> WorkspaceLayout {
    let align = |x: u64| x.div_ceil(256) * 256;
    let kv_elems = s.batch * s.seq_local * s.kv_heads * s.head_dim;
    let kv_bytes = if s.nranks > 1 { 2 * dtype.element().bytes_of(kv_elems) as u64 } else { 0 };
    let rows_bytes = (s.batch * s.heads * plan.q_tiles * BLOCK_Y * 8) as u64;
    let slot_bytes = (2 * BLOCK_X * s.head_dim * std::mem::size_of::<f32>()) as u64;
    let slots_bytes = (s.nranks as u64 - 1) * plan.kv_items as u64 * slot_bytes;
    let rows = align(kv_bytes);
    let slots = align(rows + rows_bytes);
    let tiles = (s.batch * s.heads * plan.q_tiles) as u64;
    let (sums_bytes, turns_bytes) = match plan.engine {
        RingBackwardEngine::TwoPass => (0, 0),
        _ => (tiles * (BLOCK_Y * s.head_dim * 4) as u64, tiles * 8),
    };
    let dq_sums = align(slots + slots_bytes);
    let dq_turns = align(dq_sums + sums_bytes);
    WorkspaceLayout { kv: 0, rows, slots, dq_sums, dq_turns, bytes: dq_turns + turns_bytes }
}

/// A validated mkRingAttentionBackward call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RingBackwardArgs {
    /// q, k, v, out (the forward's output) and lse as the forward takes them; `lse` is the
    /// forward's.
    pub forward: RingArgs,
    pub dout: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
}

/// Argument checks (no CUDA); messages name the rule.
#[allow(clippy::too_many_arguments)]
pub fn validate_args(
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    dout: u64,
    lse: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    batch: usize,
    seq_local: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    softmax_scale: f32,
    causal: i32,
    dtype: RawDataType,
    nranks: usize,
    rank: usize,
) -> Result<RingBackwardArgs> {
    // Named here: the forward's checks below would name mkRingAttention.
    mkDataType_t::gemm_type_from_raw(dtype, "mkRingAttentionBackward")?;
    let forward = crate::ops::attention::ring_attention::validate_args(
        q,
        k,
        v,
        out,
        lse,
        batch,
        seq_local,
        heads,
        kv_heads,
        head_dim,
        softmax_scale,
        causal,
        dtype,
        nranks,
        rank,
    )?;
    if batch > 0 && seq_local > 0 {
        for (ptr, name) in [(dout, "dout"), (dq, "dq"), (dk, "dk"), (dv, "dv")] {
            crate::ensure_arg!(ptr != 0, "{name} is NULL");
            crate::ensure_arg!(ptr % 16 == 0, "{name} = {ptr:#x} is not 16-byte aligned");
        }
    }
    Ok(RingBackwardArgs { forward, dout, dq, dk, dv })
}
/// The backward kernel of `engine` for `dtype` and `head_dim` (MK_RING_ATTN_BWD_ENTRY lines;
/// MK_RING_ATTN_BWD_ONE_PASS_ENTRY for both one-pass engines, which differ in a parameter).
pub fn kernel_for(engine: RingBackwardEngine, dtype: impl Element, head_dim: usize) -> Result<Kernel> {
    let args = [Arg::Element, Arg::Int(head_dim)];
    let entry = match engine {
        RingBackwardEngine::TwoPass => "MK_RING_ATTN_BWD_ENTRY",
        _ => "MK_RING_ATTN_BWD_ONE_PASS_ENTRY",
    };
    kernels::choose("mkRingAttentionBackward", dtype.element(), entry, &args)
}

/// The kernel's TMA descriptors (ring_attention_backward.cu `BwdMaps`): q and dout of this
/// rank, K and V of every source where this rank reads them; sources ≥ nranks stay zero.
#[repr(C)]
#[derive(Clone, Copy)]
struct BwdMaps {
    q: sys::CUtensorMap,
    dout: sys::CUtensorMap,
    k: [sys::CUtensorMap; MK_MAX_PEERS],
    v: [sys::CUtensorMap; MK_MAX_PEERS],
}

/// A 4-D map over a [batch][token][head][d] tensor, box {64 d, 1 head, 64 tokens, 1 batch},
/// zeros past `tokens`.
fn head_map(ptr: u64, dtype: mkDataType_t, s: &RingShape, heads: usize) -> Result<sys::CUtensorMap> {
    let row = dtype.size() as u64 * s.head_dim as u64;
    crate::ops::common::launch::tiled_tensor_map(
        ptr,
        dtype,
        &[s.head_dim as u64, heads as u64, s.seq_local as u64, s.batch as u64],
        &[row, row * heads as u64, row * (heads * s.seq_local) as u64],
        &[64, 1, BLOCK_Y as u32, 1],
        "cuTensorMapEncodeTiled (mkRingAttentionBackward)",
    )
}

/// One call's launch, all of it but the stream: made once per (communicator, arguments)
/// and kept (`prepared`), since it depends on nothing else.
#[derive(Clone, Copy)]
struct PreparedLaunch {
    kernel_launch: KernelLaunch,
    /// The kernel's `CUfunction` in the communicator's context, as an integer (kept across
    /// threads; a loaded function stays valid for the process: `cuda::function`).
    function: usize,
    params: RingAttnBwdParams,
    maps: BwdMaps,
}

/// What a prepared launch depends on besides its communicator (`instance`): every field
/// of the call's arguments (the scale by its bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct CallKey {
    instance: u64,
    buffers: [u64; 9],
    shape: RingShape,
    rank: usize,
    scale_bits: u32,
    dtype: mkDataType_t,
}

/// The launch of `args` on `comm` (its context current): kept from an earlier call with the
/// same arguments on the same communicator, else planned now. A communicator's rank,
/// workspace, grid cap, tuning and device never change while it lives, and its `instance`
/// is never reused, so a kept launch is the one planning would make again. Refusals are
/// not kept.
fn prepared(comm: &Comm, args: &RingBackwardArgs) -> Result<Arc<PreparedLaunch>> {
    static PREPARED: Memo<CallKey, Arc<PreparedLaunch>> = Memo::new(256);
    let f = &args.forward;
    let key = CallKey {
        instance: comm.instance,
        buffers: [f.q, f.k, f.v, f.out, f.lse, args.dout, args.dq, args.dk, args.dv],
        shape: f.shape,
        rank: f.rank,
        scale_bits: f.softmax_scale.to_bits(),
        dtype: f.dtype,
    };
    PREPARED.get_or_try(key, |_| prepare(comm, args).map(Arc::new))
}

/// Chooses the engine and plans `args` on `comm` (its context current), checks the workspace
/// holds the layout, and encodes the tensor maps; loads the kernel.
fn prepare(comm: &Comm, args: &RingBackwardArgs) -> Result<PreparedLaunch> {
    let f = &args.forward;
    let s = f.shape;
    let ws = comm.one_node_workspace("mkRingAttentionBackward")?;
    let grid_cap = DeviceCaps::of(comm)?.grid_cap();
    let engine = choose_engine(comm.config.tuning.ring_bwd_engine, &s, grid_cap, f.dtype, ws.view.op_bytes);
    let plan = plan_for(&s, grid_cap, engine);
    let layout = workspace_layout(&s, &plan, f.dtype);
    if layout.bytes > ws.view.op_bytes {
        return Err(MkError::invalid_usage(format!(
            "mkRingAttentionBackward ({} engine) keeps this rank's K/V copy, its row values, the travelling dK/dV \
             sums{} ({} bytes) in the workspace's fused-op region, which holds {}: create the communicator with \
             MK_WORKSPACE_BYTES (or mkConfig_t.workspaceBytes) of at least {}",
            plan.engine.name(),
            if plan.engine == RingBackwardEngine::TwoPass { "" } else { " and the dQ sums" },
            layout.bytes,
            ws.view.op_bytes,
            layout.bytes
        )));
    }
    if s.nranks > 1 && plan.kv_items > RING_BWD_MAX_ITEMS as usize {
        return Err(MkError::invalid_usage(format!(
            "mkRingAttentionBackward: batch × numKvHeads × ⌈seqLocal / 128⌉ = {} blocks per ring step, more than the \
             {RING_BWD_MAX_ITEMS} it keeps a signal word for",
            plan.kv_items
        )));
    }
    let base = ws.view.data_bytes;
    let p = RingAttnBwdParams {
        ws: ws.view,
        q: f.q,
        k: f.k,
        v: f.v,
        out: f.out,
        dout: args.dout,
        lse: f.lse,
        dq: args.dq,
        dk: args.dk,
        dv: args.dv,
        kv_offset: base + layout.kv,
        rows_offset: base + layout.rows,
        slots_offset: base + layout.slots,
        dq_sums_offset: base + layout.dq_sums,
        dq_turns_offset: base + layout.dq_turns,
        kv_elems: (s.batch * s.seq_local * s.kv_heads * s.head_dim) as u64,
        batch: s.batch as i32,
        seq_local: s.seq_local as i32,
        heads: s.heads as i32,
        kv_heads: s.kv_heads as i32,
        causal: s.causal as i32,
        nranks: s.nranks as i32,
        rank: f.rank as i32,
        q_tiles: plan.q_tiles as i32,
        q_blocks: plan.q_blocks as i32,
        k_blocks: plan.k_blocks as i32,
        kv_items: plan.kv_items as i32,
        num_tickets: plan.tickets as i32,
        dq_atomic: (plan.engine == RingBackwardEngine::OnePassAtomic) as i32,
        scale: f.softmax_scale,
        scale_log2: f.softmax_scale * std::f32::consts::LOG2_E,
    };
    // SAFETY: CUtensorMap is plain bytes; all-zero is a valid (unused) value.
    let mut maps: BwdMaps = unsafe { std::mem::zeroed() };
    maps.q = head_map(f.q, f.dtype, &s, s.heads)?;
    maps.dout = head_map(args.dout, f.dtype, &s, s.heads)?;
    let kv_bytes = f.dtype.element().bytes_of(p.kv_elems as usize) as u64;
    for src in 0..s.nranks {
        let (k, v) = if src == f.rank {
            (f.k, f.v)
        } else {
            let at = p.ws.data[src] + p.kv_offset;
            (at, at + kv_bytes)
        };
        maps.k[src] = head_map(k, f.dtype, &s, s.kv_heads)?;
        maps.v[src] = head_map(v, f.dtype, &s, s.kv_heads)?;
    }
    let kernel_launch = plan.kernel_launch(f.dtype)?;
    let function = kernel_launch.kernel.function()? as usize;
    Ok(PreparedLaunch { kernel_launch, function, params: p, maps })
}

/// mkRingAttentionBackward on `comm`: validate, plan, launch (stream-ordered, no host sync).
pub fn ring_attention_backward(comm: &Comm, args: &RingBackwardArgs, stream: sys::CUstream) -> Result<()> {
    comm.check_usable()?;
    let f = &args.forward;
    let s = f.shape;
    if s.batch == 0 || s.seq_local == 0 {
        return Ok(());
    }
    crate::ensure_arg!(
        s.nranks <= MK_MAX_PEERS,
        "{} ranks: mkRingAttentionBackward reads at most {MK_MAX_PEERS} K/V sources",
        s.nranks
    );
    let _ctx = comm.context.enter()?;
    comm.check_buffers(&[
        (f.q, "q"),
        (f.k, "k"),
        (f.v, "v"),
        (f.out, "out"),
        (f.lse, "lse"),
        (args.dout, "dout"),
        (args.dq, "dq"),
        (args.dk, "dk"),
        (args.dv, "dv"),
    ])?;
    let ws = comm.one_node_workspace("mkRingAttentionBackward")?;
    // One copy of the kept launch, whose parameters the driver reads from this stack.
    let PreparedLaunch { kernel_launch, function, mut params, mut maps } = *prepared(comm, args)?;
    fused_fence::launch_fenced(comm, &ws.view, None, FusedKernel::RingAttentionBackward, stream, || {
        let mut kernel_params: [*mut c_void; 2] =
            [(&mut params as *mut RingAttnBwdParams).cast(), (&mut maps as *mut BwdMaps).cast()];
        // SAFETY: the parameters match the kernel (RingAttnBwdParams and BwdMaps by value); the
        // tensors were checked to be device memory of this device, of the sizes the caller
        // promised, and the maps describe exactly those tensors; the workspace holds the
        // layout; `function` is the kernel loaded in this context.
        unsafe {
            kernel_launch.launch_loaded(
                function as sys::CUfunction,
                stream,
                &mut kernel_params,
                Some("mkRingAttentionBackward"),
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::attention::ring_attention::rank_spans;

    fn shape(batch: usize, seq_local: usize, heads: usize, kv_heads: usize, causal: bool, nranks: usize) -> RingShape {
        RingShape { batch, seq_local, heads, kv_heads, head_dim: 64, causal, nranks }
    }

    #[test]
    fn every_block_sums_every_rank_once_and_ends_at_its_owner() {
        for n in 1..=8 {
            for owner in 0..n {
                let order = chain_order(owner, n);
                assert_eq!(*order.last().unwrap(), owner, "n={n}: the owner adds last and writes dk/dv");
                let mut seen = order.clone();
                seen.sort();
                assert_eq!(seen, (0..n).collect::<Vec<_>>());
                for (step, &rank) in order.iter().enumerate() {
                    assert_eq!(kv_step_source(rank, step, n), owner, "rank {rank} holds the block at step {step}");
                    if step > 0 {
                        // It reads the previous sum from its ring successor.
                        assert_eq!(order[step - 1], (rank + 1) % n);
                    }
                }
            }
            // At each step the ranks work on n different blocks.
            for step in 0..n {
                let mut srcs: Vec<usize> = (0..n).map(|r| kv_step_source(r, step, n)).collect();
                srcs.sort();
                assert_eq!(srcs, (0..n).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn tokens_before_counts_the_prefix_of_earlier_positions() {
        for causal in [false, true] {
            for n in 1..=5 {
                let s = shape(1, 2 * 19, 2, 1, causal, n);
                for r in 0..n {
                    for pos in 0..=s.seq_local * n + 3 {
                        let direct = (0..s.seq_local).filter(|&i| token_pos(&s, r, i) < pos).count();
                        assert_eq!(tokens_before(&s, r, pos), direct, "causal={causal} n={n} r={r} pos={pos}");
                    }
                }
            }
        }
    }

    /// Every visible (query, key) pair of every (rank, source) is met by exactly the tiles
    /// the two walks take: a dK/dV item's query tiles and a dQ item's key tiles, and the
    /// tiles left out hold no visible pair.
    #[test]
    fn walks_meet_every_visible_pair_and_skip_only_masked_tiles() {
        for causal in [false, true] {
            for n in 1..=4 {
                for seq_local in [2, 64, 130, 200, 300] {
                    let s = shape(1, seq_local, 2, 1, causal, n);
                    let visible = |r: usize, src: usize, q: usize, k: usize| {
                        q < seq_local && k < seq_local && (!causal || token_pos(&s, src, k) <= token_pos(&s, r, q))
                    };
                    let q_tiles = seq_local.div_ceil(BLOCK_Y);
                    for r in 0..n {
                        for src in 0..n {
                            for block in 0..seq_local.div_ceil(BLOCK_X) {
                                // dK/dV: keys block·128.., every query tile.
                                let walked = query_tiles(&s, r, src, block);
                                for qt in 0..q_tiles {
                                    let any = (block * BLOCK_X..(block + 1) * BLOCK_X)
                                        .any(|k| (qt * BLOCK_Y..(qt + 1) * BLOCK_Y).any(|q| visible(r, src, q, k)));
                                    if any {
                                        assert!(walked.contains(&qt), "{s:?} r={r} src={src} kb={block} qt={qt}");
                                    }
                                }
                                // dQ: queries block·128.., the key tiles of src.
                                let tiles = key_tiles(&s, r, src, block);
                                for kt in 0..seq_local.div_ceil(BLOCK_Y) {
                                    let any = (kt * BLOCK_Y..(kt + 1) * BLOCK_Y).any(|k| {
                                        (block * BLOCK_X..(block + 1) * BLOCK_X).any(|q| visible(r, src, q, k))
                                    });
                                    assert_eq!(kt < tiles, any, "{s:?} r={r} src={src} qb={block} kt={kt}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Causal skipping: the walked query tiles of a dK/dV item start at the first one that
    /// is not entirely masked, so a skipped tile never holds a visible pair, and a walked
    /// range is a suffix (the kernel's first_tile).
    #[test]
    fn causal_dkdv_walks_skip_the_masked_prefix_exactly() {
        for n in 1..=4 {
            let s = shape(1, 256, 2, 2, true, n);
            for r in 0..n {
                for src in 0..n {
                    for block in 0..2 {
                        let walked = query_tiles(&s, r, src, block);
                        assert_eq!(walked.end, 4);
                        if walked.start > 0 {
                            let qt = walked.start - 1;
                            let kmin = token_pos(&s, src, block * BLOCK_X);
                            let q_last = token_pos(&s, r, qt * BLOCK_Y + BLOCK_Y - 1);
                            assert!(q_last < kmin, "tile {qt} holds a query at or after the block's first key");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn tickets_cover_every_item_once_step_by_step() {
        let s = RingShape { batch: 2, seq_local: 300, heads: 6, kv_heads: 2, head_dim: 128, causal: true, nranks: 3 };
        let p = plan_for(&s, 132, RingBackwardEngine::TwoPass);
        assert_eq!((p.q_tiles, p.q_blocks, p.k_blocks, p.kv_items), (5, 3, 3, 12));
        assert_eq!(p.tickets, 3 * 12 + 2 * 6 * 3);
        let mut kv = std::collections::BTreeSet::new();
        let mut dq = std::collections::BTreeSet::new();
        let mut last_step = 0;
        for i in 0..p.tickets {
            match p.ticket(&s, i) {
                Ticket::KeyBlock { step, index, batch, kv_head, block } => {
                    assert!(step >= last_step, "dK/dV tickets run step by step");
                    last_step = step;
                    assert_eq!(index, (batch * s.kv_heads + kv_head) * p.k_blocks + block);
                    assert!(kv.insert((step, batch, kv_head, block)));
                }
                Ticket::QueryBlock { batch, head, block } => {
                    assert!(kv.len() == s.nranks * p.kv_items, "dQ tickets follow every dK/dV ticket");
                    assert!(dq.insert((batch, head, block)));
                }
            }
        }
        assert_eq!(kv.len(), 3 * 12);
        assert_eq!(dq.len(), 2 * 6 * 3);
        assert_eq!(plan_for(&s, 16, RingBackwardEngine::TwoPass).grid, 16);
        // One-pass: the dK/dV tickets only.
        let one = plan_for(&s, 132, RingBackwardEngine::OnePass);
        assert_eq!(one.tickets, 3 * 12);
        assert!((0..one.tickets).all(|i| matches!(one.ticket(&s, i), Ticket::KeyBlock { .. })));
    }

    #[test]
    fn workspace_layout_and_shared_memory() {
        let s = RingShape { batch: 1, seq_local: 200, heads: 4, kv_heads: 2, head_dim: 128, causal: false, nranks: 4 };
        let p = plan_for(&s, 132, RingBackwardEngine::TwoPass);
        let l = workspace_layout(&s, &p, mkDataType_t::mkBfloat16);
        let kv = 2 * 200 * 2 * 128 * 2;
        assert_eq!(l.rows, (kv as u64).div_ceil(256) * 256);
        assert_eq!(l.slots, (l.rows + 4 * 4 * 64 * 8).div_ceil(256) * 256);
        assert_eq!(l.bytes, l.slots + 3 * (2 * 2) * (2 * 128 * 128 * 4));
        assert!(l.rows % 16 == 0 && l.slots % 16 == 0, "bulk copies and float4 slots need 16-byte alignment");
        let one = workspace_layout(&RingShape { nranks: 1, ..s }, &p, mkDataType_t::mkBfloat16);
        assert_eq!((one.rows, one.slots), (0, 4 * 4 * 64 * 8), "one rank: no K/V copy and no slots");
        assert_eq!((l.dq_sums, l.dq_turns), (l.bytes, l.bytes), "two-pass: no dQ sums");
        // One-pass: 4 · 4 query tiles of 64 × 128 fp32 sums and a turn word each, after the slots.
        let l1 = workspace_layout(&s, &plan_for(&s, 132, RingBackwardEngine::OnePass), mkDataType_t::mkBfloat16);
        assert_eq!(l1.dq_sums, l.bytes.div_ceil(256) * 256);
        assert_eq!(l1.dq_turns, l1.dq_sums + 16 * 64 * 128 * 4);
        assert_eq!(l1.bytes, l1.dq_turns + 16 * 8);
        assert!(l1.dq_sums % 16 == 0, "bulk reduce-adds need 16-byte alignment");
        use RingBackwardEngine::*;
        assert_eq!(smem_bytes(TwoPass, 128), 198656);
        assert!(smem_bytes(TwoPass, 128) <= 232448, "fits the 227 KiB a block may opt in to");
        assert_eq!(smem_bytes(TwoPass, 64), 100352);
        assert_eq!(smem_bytes(OnePass, 128), 231424);
        assert!(smem_bytes(OnePass, 128) + 1024 <= 232448, "fits beside the kernel's 1 KiB of static barriers");
        assert_eq!(smem_bytes(OnePassAtomic, 64), 133120);
    }

    #[test]
    fn auto_takes_one_pass_exactly_when_the_workspace_holds_it() {
        let s = RingShape { batch: 1, seq_local: 200, heads: 4, kv_heads: 2, head_dim: 128, causal: false, nranks: 4 };
        let need =
            workspace_layout(&s, &plan_for(&s, 132, RingBackwardEngine::OnePass), mkDataType_t::mkBfloat16).bytes;
        let choose = |tuned, bytes| choose_engine(tuned, &s, 132, mkDataType_t::mkBfloat16, bytes);
        assert_eq!(choose(None, need), RingBackwardEngine::OnePass);
        assert_eq!(choose(None, need - 1), RingBackwardEngine::TwoPass);
        // A set engine is kept, even where the workspace is short: the call then says so.
        assert_eq!(choose(Some(RingBackwardEngine::OnePassAtomic), need - 1), RingBackwardEngine::OnePassAtomic);
        assert_eq!(choose(Some(RingBackwardEngine::TwoPass), need), RingBackwardEngine::TwoPass);
        // The default workspace at the largest one-rank shape (S 32K, H 32, D 128) is
        // short of one-pass's 512 MiB of dQ sums: auto falls back rather than fail.
        let big =
            RingShape { batch: 1, seq_local: 32768, heads: 32, kv_heads: 32, head_dim: 128, causal: true, nranks: 1 };
        let d = choose_engine(None, &big, 132, mkDataType_t::mkBfloat16, 256 << 20);
        assert_eq!(d, RingBackwardEngine::TwoPass);
    }

    /// One-pass dQ order: for every query tile, the dK/dV items whose walks take it, listed in
    /// ticket order (ring step, then key block), are exactly the prefixes `dq_key_blocks`
    /// counts, and each item's place in that list is its `dq_turn`: the turns of a tile are
    /// 0, 1, 2, … with no gap (the last partial is never waited for in vain) and every item
    /// waits only for earlier tickets.
    #[test]
    fn dq_turns_number_every_tiles_partials_in_ticket_order() {
        for causal in [false, true] {
            for n in 1..=4 {
                for seq_local in [2, 64, 130, 200, 256, 300] {
                    let s = shape(1, seq_local, 2, 1, causal, n);
                    let q_tiles = seq_local.div_ceil(BLOCK_Y);
                    let k_blocks = seq_local.div_ceil(BLOCK_X);
                    for r in 0..n {
                        for m in 0..q_tiles {
                            let mut turn = 0;
                            for step in 0..n {
                                let src = kv_step_source(r, step, n);
                                let walking: Vec<usize> =
                                    (0..k_blocks).filter(|&kb| query_tiles(&s, r, src, kb).contains(&m)).collect();
                                assert_eq!(
                                    walking,
                                    (0..dq_key_blocks(&s, r, src, m)).collect::<Vec<_>>(),
                                    "{s:?} r={r} step={step} m={m}: a prefix of the blocks"
                                );
                                for kb in walking {
                                    assert_eq!(
                                        dq_turn(&s, r, m, step, kb),
                                        turn,
                                        "{s:?} r={r} m={m} step={step} kb={kb}"
                                    );
                                    turn += 1;
                                }
                            }
                            assert!(turn > 0, "{s:?} r={r} m={m}: every query tile gets a partial (its own keys)");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn call_arguments_are_checked_with_the_rule() {
        let bf16 = mkDataType_t::mkBfloat16 as RawDataType;
        let p = 0x1000u64;
        let call = |dout: u64, dq: u64, dk: u64, dv: u64, d: usize, dtype: RawDataType| {
            validate_args(p, p, p, p, dout, p, dq, dk, dv, 1, 256, 4, 2, d, 0.1, 1, dtype, 4, 1)
        };
        assert!(call(p, p, p, p, 128, bf16).is_ok());
        assert!(call(0, p, p, p, 128, bf16).unwrap_err().message.contains("dout is NULL"));
        assert!(call(p, p + 4, p, p, 128, bf16).unwrap_err().message.contains("dq"));
        assert!(call(p, p, 0, p, 128, bf16).unwrap_err().message.contains("dk is NULL"));
        assert!(call(p, p, p, p + 2, 128, bf16).unwrap_err().message.contains("dv"));
        assert!(call(p, p, p, p, 96, bf16).unwrap_err().message.contains("headDim"));
        let f32_type = mkDataType_t::mkFloat32 as RawDataType;
        assert!(call(p, p, p, p, 64, f32_type).unwrap_err().message.contains("mkRingAttentionBackward"));
    }

    #[test]
    fn zigzag_spans_are_the_forwards() {
        // The backward reads the forward's layout: positions from ring_attention::token_pos.
        let s = shape(1, 8, 1, 1, true, 2);
        assert_eq!(rank_spans(&s, 0).iter().map(|x| x.start).collect::<Vec<_>>(), vec![0, 12]);
        assert_eq!(tokens_before(&s, 0, 12), 4);
        assert_eq!(tokens_before(&s, 1, 12), 8, "chunks 1 and 2 lie before position 12");
    }
}
