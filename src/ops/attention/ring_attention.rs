//! Ring attention (context parallel, forward): argument rules and the ring's plan (pure
//! and CPU-tested), and the launch of kernels/ring_attention.cu, which follows this plan:
//! its token positions, ring-step sources and causal block skipping are the functions
//! below (the GPU suite `mktest ring_attn` checks the kernel against a float64 reference
//! built from them).
//!
//! Layout. The global sequence of length S = n · S_local is cut into blocks:
//! - non-causal: n contiguous shards, rank r holds tokens [r·S_local, (r+1)·S_local);
//! - causal (zigzag, for load balance): 2n chunks of S_local / 2 tokens, rank r holds chunk
//!   r then chunk 2n−1−r (so S_local must be even).
//!
//! At ring step s (0 ≤ s < n) rank r attends with its queries to the K/V that started on
//! rank (r − s) mod n.

use crate::comm::Comm;
use crate::cuda::kernels::{self, Arg, Kernel};
use crate::cuda::memo::Memo;
use crate::cuda::sys;
use crate::error::{MkError, Result};
use crate::kernel_abi::{RingAttnParams, WorkspaceView, MK_MAX_PEERS};
use crate::ops::attention::TILE_ELEMENT_BYTES;
use crate::ops::common::fused_fence::{self, FusedKernel};
use crate::ops::common::launch::{DeviceCaps, KernelLaunch};
use crate::types::{mkDataType_t, Element, RawDataType};
use std::ffi::c_void;
use std::sync::Arc;

/// Queries per work item (kernel: 2 warpgroups × 64 rows) and keys per tile.
pub const BLOCK_M: usize = 128;
pub const BLOCK_N: usize = 128;
/// Threads per CTA: two math warpgroups and one loading warpgroup (the kernel traps on
/// any other block size).
pub const THREADS: u32 = 384;
/// Slots of the kernel's K ring and of its V ring (ring_attention.cu KV_STAGES).
pub const KV_STAGES: usize = 2;
/// Slots of the kernel's Q ring (ring_attention.cu Q_STAGES): the next item's Q loads
/// while the current one is computed, and each slot stages its item's O on the way out.
pub const Q_STAGES: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RingShape {
    pub batch: usize,
    pub seq_local: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub nranks: usize,
}

/// Checks the rules the header will state; messages name the rule.
pub fn validate(s: &RingShape) -> Result<()> {
    crate::ensure_arg!(s.head_dim == 64 || s.head_dim == 128, "headDim = {} is not supported: 64 or 128", s.head_dim);
    crate::ensure_arg!(
        s.kv_heads > 0 && s.heads % s.kv_heads == 0,
        "numKvHeads = {} must divide numHeads = {} (GQA)",
        s.kv_heads,
        s.heads
    );
    crate::ensure_arg!(
        !s.causal || s.seq_local % 2 == 0,
        "seqLocal = {} must be even for causal attention: each rank holds two zigzag chunks of seqLocal / 2 tokens",
        s.seq_local
    );
    if s.seq_local.checked_mul(s.nranks).is_none() {
        return Err(MkError::invalid_argument("seqLocal × nranks overflows"));
    }
    Ok(())
}

/// Global position of local token `i` on `rank` (the kernel's token_pos).
pub fn token_pos(s: &RingShape, rank: usize, i: usize) -> usize {
    if s.causal {
        let half = s.seq_local / 2;
        if i < half {
            rank * half + i
        } else {
            (2 * s.nranks - 1 - rank) * half + (i - half)
        }
    } else {
        rank * s.seq_local + i
    }
}

/// Dynamic shared memory of the kernel (ring_attention.cu smem_bytes): the Q ring of
/// Q_STAGES tiles, the K and V rings of KV_STAGES tiles each, and 1 KiB to align them to
/// the 128-byte swizzle's 1024-byte period. The kernel traps when given less.
pub fn smem_bytes(head_dim: usize) -> usize {
    (Q_STAGES * BLOCK_M + 2 * KV_STAGES * BLOCK_N) * head_dim * TILE_ELEMENT_BYTES + 1024
}

/// Bytes of the fused-op region a rank needs: its K and V copy, of elements of `dtype`.
pub fn workspace_bytes(s: &RingShape, dtype: impl Element) -> u64 {
    2 * dtype.element().bytes_of(s.batch * s.seq_local * s.kv_heads * s.head_dim) as u64
}

/// What a ring-attention launch needs from the shape and the grid cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingAttentionPlan {
    /// Query blocks of BLOCK_M local tokens per (batch, head).
    pub q_blocks: usize,
    /// Work items: (batch, head, query block).
    pub items: usize,
    /// CTAs: one per SM (the kernel uses 193 KiB of shared memory at D = 128), never more
    /// than there are items, within the grid cap (MK_MAX_CTAS: ranks sharing a GPU must all
    /// be resident).
    pub grid: u32,
    /// (batch, head) pairs per section of the dynamic order (`sched_section`).
    pub sched_section: usize,
    /// The kernel's dynamic shared memory (`smem_bytes`).
    pub smem_bytes: usize,
    /// Head dimension (64 or 128) and whether the kernel writes a trace: with the dtype,
    /// they name the kernel (`kernel_for`).
    pub head_dim: usize,
    pub traced: bool,
}

impl RingAttentionPlan {
    /// The launch of this plan for `dtype`.
    pub fn kernel_launch(&self, dtype: impl Element) -> Result<KernelLaunch> {
        let kernel = kernel_for(dtype, self.head_dim, self.traced)?;
        Ok(KernelLaunch::new(kernel, self.grid, THREADS, self.smem_bytes as u32))
    }
}

/// Plans one call on `grid_cap` CTAs (`DeviceCaps::grid_cap`); `traced` selects the
/// kernel that writes `mkbench --trace`'s timing buffer.
pub fn plan(s: &RingShape, grid_cap: u32, traced: bool) -> RingAttentionPlan {
    let q_blocks = s.seq_local.div_ceil(BLOCK_M);
    let items = s.batch * s.heads * q_blocks;
    RingAttentionPlan {
        q_blocks,
        items,
        grid: (items as u32).clamp(1, grid_cap.max(1)),
        sched_section: sched_section(s),
        smem_bytes: smem_bytes(s.head_dim),
        head_dim: s.head_dim,
        traced,
    }
}

/// K/V bytes a section of the dynamic schedule may keep in L2 at once (the H200 has 60 MB
/// of L2; CTAs of one section read the same K/V tiles at about the same time, and the
/// next section's heavy items start while the last light ones of this one run).
pub const SCHED_L2_BYTES: usize = 16 << 20;

/// (batch, head) pairs per section of the dynamic order: as many kv heads as fit their K
/// and V over every ring step in SCHED_L2_BYTES (at least one), times the query heads
/// that share each, capped at all pairs. Sections are aligned to multiples of heads /
/// kv_heads, so the query heads of one kv head never straddle two sections.
pub fn sched_section(s: &RingShape) -> usize {
    // K and V of one kv head over every ring step.
    let kv_bytes = (2 * s.nranks * s.seq_local * s.head_dim * TILE_ELEMENT_BYTES).max(1);
    let kv_heads = (SCHED_L2_BYTES / kv_bytes).max(1);
    (kv_heads * (s.heads / s.kv_heads.max(1)).max(1)).min((s.batch * s.heads).max(1))
}

/// The work item (`bh · q_blocks + j`, j = 0 the heaviest query block of pair bh, the
/// kernel's Item numbering) that ticket `i` of the dynamic schedule hands out
/// (ring_attention.cu sched_item). Tickets run through sections of `section` (batch,
/// head) pairs in turn; inside a section by weight, heaviest first (causal: later local
/// query blocks see more keys, on every rank, since local positions grow with the local
/// index), the section's pairs alternating at each weight. So the CTAs taking tickets
/// share one section's K/V in L2, and the last tickets of the call are the lightest
/// items: greedy list scheduling in this order ends with every CTA within about one
/// light item of the others (a fixed round robin of the same items leaves ~3 % idle).
pub fn sched_item(i: usize, pairs: usize, q_blocks: usize, section: usize) -> usize {
    let per_section = section * q_blocks;
    let sec = i / per_section;
    let len = section.min(pairs - sec * section); // the last section may be short
    let r = i - sec * per_section;
    let (j, pair) = (r / len, sec * section + r % len);
    pair * q_blocks + j
}

/// A validated mkRingAttention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RingArgs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub lse: u64,
    pub shape: RingShape,
    pub rank: usize,
    pub softmax_scale: f32,
    pub dtype: mkDataType_t,
    /// Per-CTA timing buffer for `mkbench ring_attn --trace` (the kernels' `_trace` twins,
    /// layout in kernels/ring_attention.cu `RingTrace`), else 0 (always, from the C API).
    pub trace: u64,
}

/// Argument checks (no CUDA); messages name the rule.
#[allow(clippy::too_many_arguments)]
pub fn validate_args(
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    lse: u64,
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
) -> Result<RingArgs> {
    let dtype = mkDataType_t::gemm_type_from_raw(dtype, "mkRingAttention")?;
    crate::ensure_arg!(causal == 0 || causal == 1, "causal = {causal} must be 0 or 1");
    crate::ensure_arg!(heads > 0, "numHeads must be positive");
    crate::ensure_arg!(
        softmax_scale.is_finite() && softmax_scale > 0.0,
        "softmaxScale = {softmax_scale} must be finite and positive"
    );
    if nranks == 0 || rank >= nranks {
        return Err(MkError::internal(format!("rank {rank} of {nranks}")));
    }
    let shape = RingShape { batch, seq_local, heads, kv_heads, head_dim, causal: causal == 1, nranks };
    validate(&shape)?;
    let global = seq_local * nranks;
    crate::ensure_arg!(global <= i32::MAX as usize / 2, "seqLocal × nranks = {global} must be below 2^30");
    let items = batch.checked_mul(heads).and_then(|x| x.checked_mul(seq_local.div_ceil(BLOCK_M)));
    crate::ensure_arg!(
        items.is_some_and(|x| x <= i32::MAX as usize),
        "batch × numHeads × ⌈seqLocal / 128⌉ must be below 2^31"
    );
    if batch > 0 && seq_local > 0 {
        for (ptr, name, align) in [(q, "q", 16), (k, "k", 16), (v, "v", 16), (out, "out", 16), (lse, "lse", 4)] {
            crate::ensure_arg!(ptr != 0, "{name} is NULL");
            crate::ensure_arg!(ptr % align == 0, "{name} = {ptr:#x} is not {align}-byte aligned");
        }
    }
    Ok(RingArgs { q, k, v, out, lse, shape, rank, softmax_scale, dtype, trace: 0 })
}

/// The ring-attention kernel for `dtype` and `head_dim`; `traced`: its twin that writes
/// `mkbench --trace`'s timing buffer (a tool kernel: `cuda::kernels::trace_twin`).
pub fn kernel_for(dtype: impl Element, head_dim: usize, traced: bool) -> Result<Kernel> {
    let args = [Arg::Element, Arg::Int(head_dim)];
    let kernel = kernels::choose("mkRingAttention", dtype.element(), "MK_RING_ATTN_ENTRY", &args)?;
    if traced {
        kernels::trace_twin(kernel)
    } else {
        Ok(kernel)
    }
}

/// The kernel's parameters for `args` and its plan (one rank, no workspace: the caller
/// adds the workspace and the schedule's counter, or the gathered K/V).
fn params(args: &RingArgs, plan: &RingAttentionPlan) -> RingAttnParams {
    let s = &args.shape;
    RingAttnParams {
        ws: WorkspaceView::default(),
        q: args.q,
        k: args.k,
        v: args.v,
        out: args.out,
        lse: args.lse,
        kv_offset: 0,
        kv_elems: (s.batch * s.seq_local * s.kv_heads * s.head_dim) as u64,
        kv_gathered: 0,
        v_gathered: 0,
        batch: s.batch as i32,
        seq_local: s.seq_local as i32,
        heads: s.heads as i32,
        kv_heads: s.kv_heads as i32,
        causal: s.causal as i32,
        nranks: s.nranks as i32,
        rank: args.rank as i32,
        q_blocks: plan.q_blocks as i32,
        num_items: plan.items as i32,
        scale_log2: args.softmax_scale * std::f32::consts::LOG2_E,
        sched_dynamic: 0,
        sched_section: plan.sched_section as i32,
    }
}

/// The kernel's TMA descriptors (ring_attention.cu `RingAttnMaps`, its second parameter,
/// `__grid_constant__`): Q, and K and V of every source rank at the address this rank
/// reads them from; maps of sources ≥ nranks stay zero and are never used.
#[repr(C)]
#[derive(Clone, Copy)]
struct RingAttnMaps {
    q: sys::CUtensorMap,
    k: [sys::CUtensorMap; MK_MAX_PEERS],
    v: [sys::CUtensorMap; MK_MAX_PEERS],
}

/// A 4-D TMA map over a [batch][token][head][d] tensor at `ptr` (d contiguous), box
/// {64 d, 1 head, BLOCK_M tokens, 1 batch} = one 128-byte-swizzled 128 x 128-byte tile
/// block, zeros out of bounds (tokens past `tokens`: the kernel's tail rows). Needs
/// ptr % 16 == 0 (checked for the caller's tensors; workspace regions are aligned).
fn head_map(
    ptr: u64,
    dtype: mkDataType_t,
    batch: usize,
    tokens: usize,
    heads: usize,
    head_dim: usize,
) -> Result<sys::CUtensorMap> {
    let row = dtype.size() as u64 * head_dim as u64;
    crate::ops::common::launch::tiled_tensor_map(
        ptr,
        dtype,
        &[head_dim as u64, heads as u64, tokens as u64, batch as u64],
        &[row, row * heads as u64, row * (heads * tokens) as u64],
        &[64, 1, BLOCK_M as u32, 1],
        "cuTensorMapEncodeTiled (mkRingAttention)",
    )
}

/// Where the kernel reads source rank `src`'s K (`value` false) or V: the gathered
/// buffers, the caller's own tensors, or the peer's fused-op region through the peer
/// mapping (the kernel's K/V source rule), for elements of `dtype`.
fn kv_source(p: &RingAttnParams, dtype: mkDataType_t, src: usize, value: bool) -> u64 {
    let bytes = dtype.element().bytes_of(p.kv_elems as usize) as u64;
    if p.kv_gathered != 0 {
        (if value { p.v_gathered } else { p.kv_gathered }) + src as u64 * bytes
    } else if src == p.rank as usize {
        if value {
            p.v
        } else {
            p.k
        }
    } else {
        p.ws.data[src] + p.kv_offset + if value { bytes } else { 0 }
    }
}

fn tensor_maps(args: &RingArgs, p: &RingAttnParams) -> Result<RingAttnMaps> {
    let s = &args.shape;
    crate::ensure_arg!(
        s.nranks <= MK_MAX_PEERS,
        "{} ranks: mkRingAttention reads at most {MK_MAX_PEERS} K/V sources",
        s.nranks
    );
    // SAFETY: CUtensorMap is plain bytes; all-zero is a valid (unused) value.
    let mut maps: RingAttnMaps = unsafe { std::mem::zeroed() };
    maps.q = head_map(p.q, args.dtype, s.batch, s.seq_local, s.heads, s.head_dim)?;
    for src in 0..s.nranks {
        maps.k[src] =
            head_map(kv_source(p, args.dtype, src, false), args.dtype, s.batch, s.seq_local, s.kv_heads, s.head_dim)?;
        maps.v[src] =
            head_map(kv_source(p, args.dtype, src, true), args.dtype, s.batch, s.seq_local, s.kv_heads, s.head_dim)?;
    }
    Ok(maps)
}

/// Launches `plan` with parameters `p` (the context current).
fn launch(args: &RingArgs, plan: &RingAttentionPlan, p: RingAttnParams, stream: sys::CUstream) -> Result<()> {
    let kernel_launch = plan.kernel_launch(args.dtype)?;
    let maps = tensor_maps(args, &p)?;
    let function = kernel_launch.kernel.function()? as usize;
    PreparedLaunch { kernel_launch, function, params: p, maps, trace: args.trace }.launch(stream)
}

/// One call's launch, all of it but the stream: made once per (communicator, arguments)
/// and kept (`prepared`), since it depends on nothing else.
#[derive(Clone, Copy)]
struct PreparedLaunch {
    kernel_launch: KernelLaunch,
    /// The kernel's `CUfunction` in the communicator's context, as an integer (kept across
    /// threads; a loaded function stays valid for the process: `cuda::function`).
    function: usize,
    params: RingAttnParams,
    maps: RingAttnMaps,
    trace: u64,
}

impl PreparedLaunch {
    /// Launches it on `stream` (the communicator's context current).
    fn launch(mut self, stream: sys::CUstream) -> Result<()> {
        // The `_trace` twin takes the buffer as a third parameter; the plain kernels two.
        let traced = self.trace != 0;
        let mut kernel_params: [*mut c_void; 3] = [
            (&mut self.params as *mut RingAttnParams).cast(),
            (&mut self.maps as *mut RingAttnMaps).cast(),
            (&mut self.trace as *mut u64).cast(),
        ];
        let kernel_params = if traced { &mut kernel_params[..] } else { &mut kernel_params[..2] };
        let function = self.function as sys::CUfunction;
        // SAFETY: the parameters match the kernel (RingAttnParams and RingAttnMaps by value,
        // and the `_trace` twin's u64); the tensors were checked to be device memory of this
        // device, of the sizes the caller promised, and the maps describe exactly those
        // tensors; `function` is the kernel loaded in the communicator's context. The launch
        // opts in to the dynamic shared memory, which passes 48 KiB at every head dimension
        // (97 KiB at D = 64, 193 KiB at D = 128).
        unsafe { self.kernel_launch.launch_loaded(function, stream, kernel_params, Some("mkRingAttention")) }
    }
}

/// What a prepared launch depends on besides its communicator (`instance`): every field
/// of the call's arguments (the scale by its bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct CallKey {
    instance: u64,
    buffers: [u64; 5],
    shape: RingShape,
    rank: usize,
    scale_bits: u32,
    dtype: mkDataType_t,
    trace: u64,
}

/// The launch of `args` on `comm` (its context current): kept from an earlier call with the
/// same arguments on the same communicator, else planned now. A communicator's rank,
/// workspace, grid cap and device never change while it lives, and its `instance` is never
/// reused, so a kept launch is the one planning would make again. Refusals are not kept.
fn prepared(comm: &Comm, args: &RingArgs) -> Result<Arc<PreparedLaunch>> {
    static PREPARED: Memo<CallKey, Arc<PreparedLaunch>> = Memo::new(256);
    let key = CallKey {
        instance: comm.instance,
        buffers: [args.q, args.k, args.v, args.out, args.lse],
        shape: args.shape,
        rank: args.rank,
        scale_bits: args.softmax_scale.to_bits(),
        dtype: args.dtype,
        trace: args.trace,
    };
    PREPARED.get_or_try(key, |_| prepare(comm, args).map(Arc::new))
}

/// Plans `args` on `comm` (its context current), checks the workspace holds them, and
/// encodes the tensor maps; loads the kernel.
fn prepare(comm: &Comm, args: &RingArgs) -> Result<PreparedLaunch> {
    let s = args.shape;
    let plan = plan(&s, DeviceCaps::of(comm)?.grid_cap(), args.trace != 0);
    let mut p = params(args, &plan);
    if s.nranks > 1 {
        let ws = comm.one_node_workspace("mkRingAttention")?;
        let needed = workspace_bytes(&s, args.dtype);
        if needed > ws.view.op_bytes {
            return Err(MkError::invalid_usage(format!(
                "mkRingAttention copies this rank's K and V ({needed} bytes) into the workspace's fused-op region, which \
                 holds {}: create the communicator with MK_WORKSPACE_BYTES (or mkConfig_t.workspaceBytes) of at least {needed}",
                ws.view.op_bytes
            )));
        }
        p.ws = ws.view;
        p.kv_offset = ws.view.data_bytes;
    }
    // The dynamic schedule's counter lives in the signal region, which one rank has too.
    if let Some(ws) = &comm.workspace {
        p.ws = ws.view;
        p.sched_dynamic = 1;
    }
    let kernel_launch = plan.kernel_launch(args.dtype)?;
    let maps = tensor_maps(args, &p)?;
    let function = kernel_launch.kernel.function()? as usize;
    Ok(PreparedLaunch { kernel_launch, function, params: p, maps, trace: args.trace })
}

/// mkRingAttention on `comm`: validate, plan, launch (stream-ordered, no host sync).
pub fn ring_attention(comm: &Comm, args: &RingArgs, stream: sys::CUstream) -> Result<()> {
    comm.check_usable()?;
    let s = args.shape;
    if s.batch == 0 || s.seq_local == 0 {
        return Ok(());
    }
    let _ctx = comm.context.enter()?;
    comm.check_buffers(&[(args.q, "q"), (args.k, "k"), (args.v, "v"), (args.out, "out"), (args.lse, "lse")])?;
    // One copy of the kept launch, whose parameters the driver reads from this stack.
    let prepared: PreparedLaunch = *prepared(comm, args)?;
    match &comm.workspace {
        Some(ws) => fused_fence::launch_fenced(comm, &ws.view, None, FusedKernel::RingAttention, stream, || {
            prepared.launch(stream)
        }),
        None => prepared.launch(stream),
    }
}

/// The attention alone over K/V already gathered in local buffers (shard of source rank s
/// at element s · batch·seqLocal·numKvHeads·headDim, as mkAllGather leaves them): what
/// the unfused baseline runs after its communication. Same masking and positions as the
/// ring; no signals. `grid_cap` bounds the CTAs.
pub fn attention_gathered(
    args: &RingArgs,
    k_gathered: u64,
    v_gathered: u64,
    grid_cap: u32,
    stream: sys::CUstream,
) -> Result<()> {
    let s = args.shape;
    if s.batch == 0 || s.seq_local == 0 {
        return Ok(());
    }
    let plan = plan(&s, grid_cap, args.trace != 0);
    let mut p = params(args, &plan);
    p.kv_gathered = k_gathered;
    p.v_gathered = v_gathered;
    launch(args, &plan, p, stream)
}

/// A span of global token positions, [start, start + len).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub len: usize,
}

/// The global positions a rank's local tokens stand for, in local order.
pub fn rank_spans(s: &RingShape, rank: usize) -> Vec<Span> {
    if s.causal {
        let half = s.seq_local / 2;
        let n = s.nranks;
        vec![Span { start: rank * half, len: half }, Span { start: (2 * n - 1 - rank) * half, len: half }]
    } else {
        vec![Span { start: rank * s.seq_local, len: s.seq_local }]
    }
}

/// How a block of queries sees a block of keys under the causal mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Visibility {
    /// Every key precedes or equals every query: no mask needed.
    Full,
    /// Some pairs are masked: apply the causal mask elementwise.
    Partial,
    /// Every key follows every query: skip the block.
    None,
}

pub fn visibility(causal: bool, q: Span, k: Span) -> Visibility {
    if !causal || q.start >= k.start + k.len - 1 {
        Visibility::Full
    } else if k.start > q.start + q.len - 1 {
        Visibility::None
    } else {
        Visibility::Partial
    }
}

/// One unit of a ring step's work: a local query span against a K/V span held this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockPair {
    pub q: Span,
    pub k: Span,
    pub visibility: Visibility,
}

/// The work of `rank` at ring step `step`: every (query span, key span) pair that is not
/// fully masked, and the rank whose K/V it uses.
pub fn step_work(s: &RingShape, rank: usize, step: usize) -> (usize, Vec<BlockPair>) {
    let n = s.nranks;
    let source = (rank + n - step % n) % n;
    let mut pairs = Vec::new();
    for q in rank_spans(s, rank) {
        for k in rank_spans(s, source) {
            let v = visibility(s.causal, q, k);
            if v != Visibility::None {
                pairs.push(BlockPair { q, k, visibility: v });
            }
        }
    }
    (source, pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(seq_local: usize, causal: bool, nranks: usize) -> RingShape {
        RingShape { batch: 1, seq_local, heads: 32, kv_heads: 8, head_dim: 128, causal, nranks }
    }

    #[test]
    fn rules_are_named() {
        assert!(validate(&RingShape { head_dim: 96, ..shape(1024, false, 4) })
            .unwrap_err()
            .message
            .contains("headDim"));
        assert!(validate(&RingShape { kv_heads: 5, ..shape(1024, false, 4) }).unwrap_err().message.contains("divide"));
        assert!(validate(&shape(1023, true, 4)).unwrap_err().message.contains("even"));
        assert!(validate(&shape(1023, false, 4)).is_ok());
    }

    #[test]
    fn spans_tile_the_sequence_exactly_once() {
        for causal in [false, true] {
            for n in 1..=8 {
                let s = shape(2 * 37, causal, n);
                let mut covered = vec![0u8; s.seq_local * n];
                for r in 0..n {
                    for sp in rank_spans(&s, r) {
                        covered[sp.start..sp.start + sp.len].iter_mut().for_each(|c| *c += 1);
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "causal={causal} n={n}");
            }
        }
    }

    /// Counts (query, key) token pairs the plan computes, with the causal mask applied
    /// elementwise on partial blocks, against a direct count over the global sequence.
    fn visible_pairs(s: &RingShape, rank: usize) -> usize {
        (0..s.nranks)
            .flat_map(|step| step_work(s, rank, step).1)
            .map(|p| match p.visibility {
                Visibility::Full => p.q.len * p.k.len,
                Visibility::Partial => {
                    (0..p.q.len).map(|i| (0..p.k.len).filter(|&j| p.k.start + j <= p.q.start + i).count()).sum()
                }
                Visibility::None => unreachable!("skipped blocks are not planned"),
            })
            .sum()
    }

    #[test]
    fn every_visible_pair_is_computed_once_and_masked_blocks_are_skipped() {
        for n in 1..=8 {
            let s = shape(16, true, n);
            for r in 0..n {
                let direct: usize =
                    rank_spans(&s, r).iter().map(|q| (0..q.len).map(|i| q.start + i + 1).sum::<usize>()).sum();
                assert_eq!(visible_pairs(&s, r), direct, "n={n} rank={r}");
            }
            let s = shape(16, false, n);
            for r in 0..n {
                assert_eq!(visible_pairs(&s, r), 16 * 16 * n);
            }
        }
    }

    #[test]
    fn zigzag_balances_causal_work_across_ranks() {
        let s = shape(64, true, 8);
        let work: Vec<usize> = (0..8).map(|r| visible_pairs(&s, r)).collect();
        let (lo, hi) = (work.iter().min().unwrap(), work.iter().max().unwrap());
        assert_eq!(lo, hi, "zigzag gives every rank the same causal work: {work:?}");
    }

    #[test]
    fn token_positions_follow_the_spans_and_grow_with_the_local_index() {
        for causal in [false, true] {
            for n in 1..=8 {
                let s = shape(2 * 45, causal, n);
                for r in 0..n {
                    let from_spans: Vec<usize> =
                        rank_spans(&s, r).iter().flat_map(|sp| sp.start..sp.start + sp.len).collect();
                    let direct: Vec<usize> = (0..s.seq_local).map(|i| token_pos(&s, r, i)).collect();
                    assert_eq!(direct, from_spans);
                    // The kernel classifies a tile by its first and last token: positions must be monotonic.
                    assert!(direct.windows(2).all(|w| w[0] < w[1]));
                }
            }
        }
    }

    #[test]
    fn grid_and_workspace_plan() {
        let s = RingShape { batch: 2, seq_local: 300, heads: 4, kv_heads: 2, head_dim: 64, causal: false, nranks: 4 };
        let p = plan(&s, 132, false);
        assert_eq!((p.q_blocks, p.items, p.grid, p.sched_section, p.smem_bytes), (3, 24, 24, 8, 99328));
        assert_eq!(plan(&s, 16, true).grid, 16);
        assert_eq!(plan(&RingShape { seq_local: 0, ..s }, 16, false).grid, 1, "at least one CTA");
        assert_eq!(workspace_bytes(&s, mkDataType_t::mkBfloat16), 2 * 2 * 300 * 2 * 64 * 2);
        assert_eq!(smem_bytes(128), 197632);
        assert_eq!(smem_bytes(64), 99328);
        assert!(smem_bytes(128) <= 232448, "fits the 227 KiB a block may opt in to");
    }

    #[test]
    fn every_plan_launches_one_cta_per_item_within_the_cap() {
        let bf16 = mkDataType_t::mkBfloat16;
        for (batch, heads, kv_heads) in [(1, 32, 32), (2, 32, 8), (4, 4, 2), (1, 1, 1), (0, 8, 8)] {
            for seq_local in [0, 1, 128, 300, 1024, 8192, 32768] {
                for head_dim in [64, 128] {
                    for (causal, nranks) in [(false, 1), (true, 1), (false, 4), (true, 8)] {
                        for grid_cap in [132, 66, 16, 1, 0] {
                            for traced in [false, true] {
                                let s = RingShape { batch, seq_local, heads, kv_heads, head_dim, causal, nranks };
                                let p = plan(&s, grid_cap, traced);
                                assert!(
                                    p.q_blocks * BLOCK_M >= seq_local && p.q_blocks * BLOCK_M < seq_local + BLOCK_M
                                );
                                assert_eq!(p.items, batch * heads * p.q_blocks);
                                assert_eq!(p.grid as usize, p.items.min(grid_cap.max(1) as usize).max(1), "{s:?}");
                                let l = p.kernel_launch(bf16).unwrap();
                                assert_eq!(l.kernel, kernel_for(bf16, head_dim, traced).unwrap());
                                assert_eq!(
                                    (l.grid, l.block, l.smem_bytes),
                                    (p.grid, THREADS, smem_bytes(head_dim) as u32)
                                );
                                assert!(l.smem_bytes > 48 * 1024, "the launch opts in to the shared memory");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn sched_sections_fit_the_l2_budget_and_keep_gqa_groups_whole() {
        let s = |seq_local: usize, heads: usize, kv_heads: usize, nranks: usize| RingShape {
            batch: 1,
            seq_local,
            heads,
            kv_heads,
            head_dim: 128,
            causal: true,
            nranks,
        };
        // 16 MiB of K and V: 4 heads at S 8K, 2 at 16K, 1 at 32K (one rank, D 128, bf16).
        assert_eq!(sched_section(&s(8192, 32, 32, 1)), 4);
        assert_eq!(sched_section(&s(16384, 32, 32, 1)), 2);
        assert_eq!(sched_section(&s(32768, 32, 32, 1)), 1);
        assert_eq!(sched_section(&s(65536, 32, 32, 1)), 1, "at least one head");
        assert_eq!(sched_section(&s(4096, 32, 32, 4)), 2, "every ring step's K/V counts");
        assert_eq!(sched_section(&s(16384, 32, 8, 1)), 8, "2 kv heads, 4 query heads each");
        assert_eq!(sched_section(&s(256, 4, 2, 1)), 4, "capped at every (batch, head) pair");
    }

    #[test]
    fn sched_order_hands_out_every_item_once_heaviest_first_per_section() {
        for (pairs, q_blocks, section) in [(32, 64, 4), (32, 128, 2), (6, 5, 4), (1, 7, 1), (7, 3, 3), (5, 1, 2)] {
            let order: Vec<usize> = (0..pairs * q_blocks).map(|i| sched_item(i, pairs, q_blocks, section)).collect();
            let mut seen = order.clone();
            seen.sort();
            assert_eq!(seen, (0..pairs * q_blocks).collect::<Vec<_>>(), "{pairs} {q_blocks} {section}");
            for w in order.windows(2) {
                let (a, b) = ((w[0] / q_blocks, w[0] % q_blocks), (w[1] / q_blocks, w[1] % q_blocks));
                // Inside a section the heaviness rank j never decreases; a new section starts at j = 0.
                if a.0 / section == b.0 / section {
                    assert!(b.1 >= a.1, "{pairs} {q_blocks} {section}: {a:?} then {b:?}");
                } else {
                    assert_eq!((b.0 / section, b.1), (a.0 / section + 1, 0));
                }
            }
        }
    }

    /// Greedy list scheduling (each CTA takes the next ticket when it finishes an item) of
    /// the one-rank causal bench shapes in the dynamic order: the busiest of 132 CTAs ends
    /// within 0.5 % of the mean (the fixed snake: 3.1 %). Cost of an item: its visible
    /// 128-key tiles plus one for the item's own overhead.
    #[test]
    fn dynamic_order_balances_causal_items() {
        for seq in [8192usize, 16384, 32768] {
            let s =
                RingShape { batch: 1, seq_local: seq, heads: 32, kv_heads: 32, head_dim: 128, causal: true, nranks: 1 };
            let RingAttentionPlan { q_blocks, items, grid, sched_section: section, .. } = plan(&s, 132, false);
            let cost = |item: usize| (q_blocks - item % q_blocks) as u64 + 1; // j = 0: the last query block, q_blocks tiles
            let mut ctas = std::collections::BinaryHeap::new();
            (0..grid).for_each(|c| ctas.push(std::cmp::Reverse((0u64, c))));
            for i in 0..items {
                let std::cmp::Reverse((t, c)) = ctas.pop().unwrap();
                ctas.push(std::cmp::Reverse((t + cost(sched_item(i, 32, q_blocks, section)), c)));
            }
            let ends: Vec<u64> = ctas.into_iter().map(|std::cmp::Reverse((t, _))| t).collect();
            let mean = ends.iter().sum::<u64>() as f64 / ends.len() as f64;
            let max = *ends.iter().max().unwrap() as f64;
            assert!(max / mean < 1.005, "S {seq}: busiest CTA {max} against a mean of {mean}");
        }
    }

    #[test]
    fn call_arguments_are_checked_with_the_rule() {
        let bf16 = mkDataType_t::mkBfloat16 as RawDataType;
        let p = 0x1000u64;
        let call = |q: u64,
                    lse: u64,
                    seq: usize,
                    heads: usize,
                    kvh: usize,
                    d: usize,
                    scale: f32,
                    causal: i32,
                    dtype: RawDataType| {
            validate_args(q, p, p, p, lse, 1, seq, heads, kvh, d, scale, causal, dtype, 4, 1)
        };
        assert!(call(p, p, 256, 4, 2, 128, 0.1, 1, bf16).is_ok());
        assert!(call(0, p, 256, 4, 2, 128, 0.1, 0, bf16).unwrap_err().message.contains("q is NULL"));
        assert!(call(p + 8, p, 256, 4, 2, 128, 0.1, 0, bf16).unwrap_err().message.contains("16-byte aligned"));
        assert!(call(p, p + 2, 256, 4, 2, 128, 0.1, 0, bf16).unwrap_err().message.contains("lse"));
        assert!(call(p, p, 255, 4, 2, 128, 0.1, 1, bf16).unwrap_err().message.contains("even"));
        assert!(call(p, p, 255, 4, 2, 128, 0.1, 0, bf16).is_ok());
        assert!(call(p, p, 256, 4, 3, 128, 0.1, 0, bf16).unwrap_err().message.contains("divide"));
        assert!(call(p, p, 256, 4, 2, 96, 0.1, 0, bf16).unwrap_err().message.contains("headDim"));
        assert!(call(p, p, 256, 4, 2, 64, 0.0, 0, bf16).unwrap_err().message.contains("softmaxScale"));
        assert!(call(p, p, 256, 4, 2, 64, f32::NAN, 0, bf16).unwrap_err().message.contains("softmaxScale"));
        assert!(call(p, p, 256, 4, 2, 64, 0.1, 2, bf16).unwrap_err().message.contains("causal"));
        assert!(call(p, p, 256, 0, 0, 64, 0.1, 0, bf16).unwrap_err().message.contains("numHeads"));
        assert!(call(p, p, 256, 4, 2, 64, 0.1, 0, mkDataType_t::mkFloat32 as RawDataType)
            .unwrap_err()
            .message
            .contains("not supported"));
        assert!(call(p, p, 256, 4, 2, 64, 0.1, 0, 77).is_err());
        // An empty problem needs no pointers.
        assert!(call(0, 0, 0, 4, 2, 64, 0.1, 0, bf16).is_ok());
    }

    #[test]
    fn step_zero_is_local_and_the_ring_visits_every_rank() {
        for n in 1..=8 {
            let s = shape(8, false, n);
            for r in 0..n {
                assert_eq!(step_work(&s, r, 0).0, r);
                let mut seen: Vec<usize> = (0..n).map(|st| step_work(&s, r, st).0).collect();
                seen.sort();
                assert_eq!(seen, (0..n).collect::<Vec<_>>());
            }
        }
    }
}
