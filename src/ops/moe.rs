//! MoE dispatch + grouped GEMM and the way back: the routing semantics and the
//! receive layout as plain Rust (the definition the kernels and their float64 reference
//! tests share), the argument checks, the plan (`MoePlan`: role split, tile, bands, raster
//! group, burst and layout tables, pure and CPU-tested), and the launches of kernels/moe.cu
//! (mkMoeDispatchGemm, mkMoeGemmCombine).
//!
//! Semantics. Rank r holds T tokens and, per token, k expert ids (−1 = none) and weights.
//! Experts are spread evenly: rank r owns experts [r·E/n, (r+1)·E/n). Dispatch sends each
//! token to every rank that owns at least one of its experts and it appears once per
//! (token, expert) in that rank's expert-grouped rows (a token listing one expert twice is
//! one row). Rows are grouped by local expert, and inside an expert by source rank, then
//! by token index: a deterministic order every rank can compute alone. On the device each
//! expert's segment starts on a 128-row boundary (`device_layout`), so GEMM tiles never
//! straddle two experts.
use crate::comm::Comm;
use crate::cuda::kernels::{self, Arg, Kernel};
use crate::cuda::sys;
use crate::error::{MkError, Result};
use crate::kernel_abi::{MoeParams, WorkspaceView};
use crate::ops::common::fused_fence::{self, FusedKernel};
use crate::ops::common::launch::{self, DeviceCaps, KernelLaunch};
use crate::ops::gemm::engine::{self as engine, Epilogue};
use crate::tuning::Tuning;
use crate::types::{mkDataType_t, Element, RawDataType};
use std::collections::HashMap;
use std::ffi::c_void;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeShape {
    /// This rank's tokens (other ranks' counts come from the length of their routing).
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
    pub nranks: usize,
    /// Drop mode: each source rank sends at most this many rows to each expert (`kept`);
    /// None: no-drop mode.
    pub expert_capacity: Option<usize>,
}

impl MoeShape {
    /// A no-drop call's shape.
    pub fn new(tokens: usize, top_k: usize, experts: usize, nranks: usize) -> MoeShape {
        MoeShape { tokens, top_k, experts, nranks, expert_capacity: None }
    }
}

/// The drop rule (drop mode, Megatron's capacity factor with its "position" policy): a
/// source rank's rows of one expert are kept in token order, the first `expert_capacity`
/// of them; a row is one distinct (token, expert) pair, so a token listing an expert twice
/// takes one place. `index` is the row's place among the source's rows of that expert.
/// Every rank decides for its own tokens alone, so the rule needs no exchange and keeps
/// each expert's rows from one source at most `expert_capacity`.
pub fn kept(expert_capacity: Option<usize>, index: usize) -> bool {
    expert_capacity.is_none_or(|c| index < c)
}

/// Drop mode: per global expert, how many of one source rank's rows (`ids`, [T × k]) the
/// drop rule drops; every entry 0 in no-drop mode. Ids outside [0, E) count nowhere.
pub fn drop_counts(s: &MoeShape, ids: &[i32]) -> Vec<usize> {
    let mut rows = vec![0usize; s.experts];
    for token in ids.chunks(s.top_k) {
        for (j, &e) in token.iter().enumerate() {
            if e >= 0 && (e as usize) < s.experts && !token[..j].contains(&e) {
                rows[e as usize] += 1;
            }
        }
    }
    rows.iter().map(|&r| s.expert_capacity.map_or(0, |c| r.saturating_sub(c))).collect()
}

pub fn validate(s: &MoeShape) -> Result<()> {
    crate::ensure_arg!(s.top_k >= 1, "k must be at least 1");
    crate::ensure_arg!(
        s.experts > 0 && s.experts % s.nranks == 0,
        "E = {} must be a positive multiple of nranks = {}: every rank owns E / nranks experts",
        s.experts,
        s.nranks
    );
    Ok(())
}

/// The rank owning expert `e`.
pub fn owner(s: &MoeShape, e: usize) -> usize {
    e / (s.experts / s.nranks)
}

/// One received row: token `token` of `source`, for local expert `local_expert`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReceivedRow {
    pub source: usize,
    pub token: usize,
    pub local_expert: usize,
}

/// What rank `rank` receives, given every rank's routing (`routing[src]` is that rank's
/// [T × k] expert ids): per local expert, its rows in order; also the number of distinct
/// tokens each source sends (what crosses the wire). Out-of-range ids are an error, −1 is
/// "no expert". In drop mode the rows the drop rule (`kept`) drops are not received.
pub fn receive_layout(s: &MoeShape, routing: &[Vec<i32>], rank: usize) -> Result<(Vec<Vec<ReceivedRow>>, Vec<usize>)> {
    validate(s)?;
    let per_rank = s.experts / s.nranks;
    let mut rows: Vec<Vec<ReceivedRow>> = vec![Vec::new(); per_rank];
    let mut tokens_from = vec![0usize; s.nranks];
    for (src, ids) in routing.iter().enumerate() {
        // This source's rows of each local expert so far (the drop rule's index).
        let mut rows_from_src = vec![0usize; per_rank];
        // Ranks may hold different numbers of tokens: each routing is [T_src, k].
        if ids.len() % s.top_k != 0 {
            return Err(MkError::invalid_argument(format!(
                "routing of rank {src} has {} ids, not a multiple of k = {}",
                ids.len(),
                s.top_k
            )));
        }
        for t in 0..ids.len() / s.top_k {
            let mut sent = false;
            let mut seen_local = Vec::with_capacity(s.top_k);
            for &e in &ids[t * s.top_k..(t + 1) * s.top_k] {
                if e == -1 {
                    continue;
                }
                if e < 0 || e as usize >= s.experts {
                    return Err(MkError::invalid_argument(format!(
                        "expert id {e} of token {t} on rank {src} is outside [0, {})",
                        s.experts
                    )));
                }
                let e = e as usize;
                if owner(s, e) != rank || seen_local.contains(&e) {
                    continue;
                }
                seen_local.push(e);
                let index = &mut rows_from_src[e - rank * per_rank];
                *index += 1;
                if !kept(s.expert_capacity, *index - 1) {
                    continue;
                }
                rows[e - rank * per_rank].push(ReceivedRow {
                    source: src,
                    token: t,
                    local_expert: e - rank * per_rank,
                });
                sent = true;
            }
            tokens_from[src] += sent as usize;
        }
    }
    Ok((rows, tokens_from))
}

/// Rows needed in the receive buffer; a caller's capacity below it is reported with this
/// number, never silently truncated.
pub fn rows_needed(layout: &[Vec<ReceivedRow>]) -> usize {
    layout.iter().map(Vec::len).sum()
}

// ---- the device layout -----------------------------------------------------------------

/// Every expert's segment of a receive buffer starts on a multiple of the GEMM row block.
pub use crate::ops::gemm::engine::ROW_BLOCK;
/// Most experts (the prep CTA keeps per-expert tables in shared memory).
pub const MAX_EXPERTS: usize = crate::kernel_abi::MOE_MAX_EXPERTS as usize;
/// Most experts per token (one warp lane per choice).
pub const MAX_TOP_K: usize = 32;
/// Bytes at the start of the fused-op region for the count exchange (nranks·E int32); the
/// receive buffer (dispatch) and Z (combine) follow it.
pub const COUNTS_BYTES: usize = 64 << 10;
/// Per-slab flags of Z (signal words MOE_TILE .. MOE_END; below them the dispatch's
/// per-(source, expert) flags at MOE_RECV and per-list counters at MOE_SENT).
pub const TILE_FLAG_WORDS: usize = (crate::kernel_abi::MOE_END - crate::kernel_abi::MOE_TILE) as usize;
/// Most 128-row blocks in a receive buffer (the m-block tables pack a block and a block
/// count into 15 bits each).
pub const MAX_CAPACITY_BLOCKS: usize = 16_384;
const WARPS: usize = crate::kernel_abi::MOE_WARPS as usize;

/// Where the tables live in the caller's layout buffer (int32 words). Words 0..4: the
/// number of row blocks in use on this rank, and whether some rank's buffer overflowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutOffsets {
    /// [T·k] owner rank of each (token, choice), −1 for none.
    pub dest: usize,
    /// [T·k] row at the owner.
    pub row: usize,
    /// [capacity / 128] local expert of each row block.
    pub mb_expert: usize,
    /// [capacity / 128] row blocks in the order the GEMM takes them.
    pub mb_order: usize,
    /// [capacity / 128] bit s: the block holds rows from rank s.
    pub mb_srcmask: usize,
    /// [capacity / 128] per block: first order position of its (key, expert) run | length << 15.
    pub mb_run: usize,
    /// [capacity / 128] per block: first block of its expert's segment | its blocks << 15.
    pub mb_seg: usize,
    /// [capacity / 128] per block: rows in use (1..=128).
    pub mb_rows: usize,
    /// [T·k] the send list (`send_tables`): slots t·k + j by (local expert, destination step).
    pub send: usize,
    /// [MAX_EXPERTS + 1] first send-list entry of each list q = le·nranks + step, [E] = total.
    pub send_row0: usize,
    pub words: usize,
}

/// Where the tables live for a call's sizes (sizes `validate_dims` accepted; see
/// [`checked_layout_offsets`] for sizes from C).
pub fn layout_offsets(tokens: usize, top_k: usize, capacity: usize) -> LayoutOffsets {
    checked_layout_offsets(tokens, top_k, capacity).expect("validated MoE sizes give a layout of fewer than 2^64 words")
}

/// [`layout_offsets`], or None when a count overflows usize.
pub fn checked_layout_offsets(tokens: usize, top_k: usize, capacity: usize) -> Option<LayoutOffsets> {
    let slots = tokens.checked_mul(top_k)?;
    let blocks = capacity.div_ceil(ROW_BLOCK);
    let dest = 4;
    let row = slots.checked_add(dest)?;
    let mb_expert = row.checked_add(slots)?;
    let mb_order = mb_expert.checked_add(blocks)?;
    let mb_srcmask = mb_order.checked_add(blocks)?;
    let mb_run = mb_srcmask.checked_add(blocks)?;
    let mb_seg = mb_run.checked_add(blocks)?;
    let mb_rows = mb_seg.checked_add(blocks)?;
    let send = mb_rows.checked_add(blocks)?;
    // E is not a parameter of mkMoeLayoutBytes: room for the most experts.
    let send_row0 = send.checked_add(slots)?;
    let words = send_row0.checked_add(MAX_EXPERTS + 1)?;
    Some(LayoutOffsets { dest, row, mb_expert, mb_order, mb_srcmask, mb_run, mb_seg, mb_rows, send, send_row0, words })
}

/// What `rank`'s kernels compute for a routing (the device's layout, for tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLayout {
    /// Rows per local expert of `rank`.
    pub recv_counts: Vec<usize>,
    /// First row of each local expert's segment (multiples of 128).
    pub expert_base: Vec<usize>,
    /// Rows of the receive buffer every rank needs, the most over ranks (the smallest
    /// recvCapacity that fits this call).
    pub rows_needed: usize,
    /// Per own (token, choice): (owner rank, row at the owner), None for −1 and for a
    /// dropped row.
    pub slots: Vec<Option<(usize, usize)>>,
    /// Rows received by `rank`, in receive-buffer order with their row index.
    pub rows: Vec<(usize, ReceivedRow)>,
}

pub fn device_layout(s: &MoeShape, routing: &[Vec<i32>], rank: usize) -> Result<DeviceLayout> {
    let per_rank = s.experts / s.nranks.max(1);
    let mut position: HashMap<(usize, usize, usize), usize> = HashMap::new(); // (owner, token of `rank`, expert) -> row
    let mut rows_needed = 0;
    let mut mine = None;
    for d in 0..s.nranks {
        let (layout, _) = receive_layout(s, routing, d)?;
        let mut base = 0;
        let mut bases = Vec::with_capacity(per_rank);
        let mut rows = Vec::new();
        for (le, group) in layout.iter().enumerate() {
            bases.push(base);
            for (i, r) in group.iter().enumerate() {
                if r.source == rank {
                    position.insert((d, r.token, d * per_rank + le), base + i);
                }
                rows.push((base + i, *r));
            }
            base += group.len().next_multiple_of(ROW_BLOCK);
        }
        rows_needed = rows_needed.max(base);
        if d == rank {
            mine = Some((layout.iter().map(Vec::len).collect::<Vec<_>>(), bases, rows));
        }
    }
    let (recv_counts, expert_base, rows) = mine.expect("rank < nranks");
    let ids = &routing[rank];
    let slots = ids
        .iter()
        .enumerate()
        .map(|(i, &e)| {
            // A dropped row has no position: None, as for −1.
            (e >= 0)
                .then(|| owner(s, e as usize))
                .and_then(|d| Some((d, *position.get(&(d, i / s.top_k, e as usize))?)))
        })
        .collect();
    Ok(DeviceLayout { recv_counts, expert_base, rows_needed, slots, rows })
}

// ---- argument checks and planning ------------------------------------------------------

/// The sizes of a call (the same on every rank, except that `tokens` is per rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub tokens: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub top_k: usize,
    pub experts: usize,
    /// Rows of Y (and of each rank's receive buffer).
    pub capacity: usize,
    pub nranks: usize,
}

impl MoeDims {
    pub fn experts_local(&self) -> usize {
        self.experts / self.nranks
    }
}

/// GEMM tile width for `cols` output columns (a multiple of 128).
pub fn tile_width(cols: usize) -> usize {
    if cols % 256 == 0 {
        256
    } else {
        128
    }
}

pub fn validate_dims(d: &MoeDims) -> Result<()> {
    validate(&MoeShape::new(d.tokens, d.top_k, d.experts, d.nranks))?;
    crate::ensure_arg!(d.top_k <= MAX_TOP_K, "k = {} exceeds {MAX_TOP_K} experts per token", d.top_k);
    crate::ensure_arg!(d.experts <= MAX_EXPERTS, "E = {} exceeds {MAX_EXPERTS} experts", d.experts);
    crate::ensure_arg!(
        d.hidden > 0 && d.hidden % 128 == 0 && d.ffn > 0 && d.ffn % 128 == 0,
        "H = {} and F = {} must be positive multiples of 128 (GEMM column tiles never straddle two experts' weights)",
        d.hidden,
        d.ffn
    );
    crate::ensure_arg!(
        d.capacity % ROW_BLOCK == 0 && d.capacity / ROW_BLOCK <= MAX_CAPACITY_BLOCKS,
        "recvCapacity = {} must be a multiple of {ROW_BLOCK} rows, at most {}",
        d.capacity,
        MAX_CAPACITY_BLOCKS * ROW_BLOCK
    );
    // Sizes come from C: every product is checked (an overflow is as out of range as a
    // product past the limit).
    let flags = (d.capacity / ROW_BLOCK).checked_mul(d.hidden / tile_width(d.hidden)).and_then(|f| f.checked_mul(2));
    crate::ensure_arg!(
        flags.is_some_and(|f| f <= TILE_FLAG_WORDS),
        "recvCapacity = {} with H = {}: {} Z-slab signals exceed the {TILE_FLAG_WORDS} MoE signal words; lower recvCapacity",
        d.capacity,
        d.hidden,
        flags.map_or("more than 2^64".into(), |f| f.to_string())
    );
    let below_2_31 = |a: usize, b: usize| a.checked_mul(b).is_some_and(|p| p < i32::MAX as usize);
    crate::ensure_arg!(
        below_2_31(d.tokens, d.top_k)
            && below_2_31(d.capacity, d.hidden)
            && below_2_31(d.tokens, d.hidden)
            && below_2_31(d.experts_local(), d.ffn.max(d.hidden)),
        "sizes too large: T·k, T·H, recvCapacity·H and E_local·max(F, H) must each stay below 2^31 (tokens = {}, topk = {}, \
         hidden = {}, ffn = {}, recvCapacity = {})",
        d.tokens,
        d.top_k,
        d.hidden,
        d.ffn,
        d.capacity
    );
    Ok(())
}

fn check_ptr(ptr: u64, name: &str, align: u64, needed: bool) -> Result<()> {
    crate::ensure_arg!(!needed || ptr != 0, "{name} is NULL");
    crate::ensure_arg!(ptr % align == 0, "{name} = {ptr:#x} is not {align}-byte aligned");
    Ok(())
}

/// A validated mkMoeDispatchGemm call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DispatchArgs {
    pub x: u64,
    pub topk_idx: u64,
    pub w1: u64,
    pub y: u64,
    pub recv_counts: u64,
    pub layout: u64,
    pub dims: MoeDims,
    pub dtype: mkDataType_t,
    pub policy: CapacityPolicy,
    /// The plain GEMM, or the gated w1's activation.
    pub activation: Activation,
    /// Per-CTA timing buffer for `mkbench moe --trace` (kernels/common/trace.cuh), else 0.
    pub trace: u64,
}

/// What a dispatch does with rows beyond the room it has (mkMoeOptions_t.capacityPolicy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapacityPolicy {
    /// Every row travels; a call whose rows exceed some rank's recvCapacity moves nothing
    /// and reports the recvCapacity it needs (recvCounts[E_local]). `drop_counts`, when
    /// not 0, receives zeros.
    NoDrop { drop_counts: u64 },
    /// Each source rank sends at most `expert_capacity` rows to each expert (`kept`);
    /// `drop_counts` [E] int32 receives this rank's dropped rows per expert.
    Drop { expert_capacity: usize, drop_counts: u64 },
}

/// mkMoeOptions_t.capacityPolicy codes.
pub const MK_MOE_NO_DROP: i32 = 0;
pub const MK_MOE_DROP: i32 = 1;

impl CapacityPolicy {
    /// The policy a C caller's `capacityPolicy`, `expertCapacity` and `dropCounts` ask for.
    pub fn from_raw(code: i32, expert_capacity: i64, drop_counts: u64) -> Result<CapacityPolicy> {
        check_ptr(drop_counts, "dropCounts", 4, false)?;
        match code {
            MK_MOE_NO_DROP => {
                crate::ensure_arg!(
                    expert_capacity == 0,
                    "options->expertCapacity = {expert_capacity} is set but options->capacityPolicy is MK_MOE_NO_DROP: \
                     no-drop mode moves every row (set capacityPolicy = MK_MOE_DROP to cap each expert's rows)"
                );
                Ok(CapacityPolicy::NoDrop { drop_counts })
            }
            MK_MOE_DROP => {
                crate::ensure_arg!(drop_counts != 0, "dropCounts is NULL: drop mode writes each expert's dropped rows there");
                crate::ensure_arg!(
                    expert_capacity >= 1 && expert_capacity <= i32::MAX as i64,
                    "options->expertCapacity = {expert_capacity}: drop mode needs the rows each rank may send to each \
                     expert, in [1, 2^31) (0 would drop every row)"
                );
                Ok(CapacityPolicy::Drop { expert_capacity: expert_capacity as usize, drop_counts })
            }
            other => Err(MkError::invalid_argument(format!(
                "options->capacityPolicy = {other} is neither MK_MOE_NO_DROP ({MK_MOE_NO_DROP}) nor MK_MOE_DROP ({MK_MOE_DROP})"
            ))),
        }
    }

    /// The drop rule's cap (`MoeShape::expert_capacity`).
    pub fn expert_capacity(&self) -> Option<usize> {
        match *self {
            CapacityPolicy::NoDrop { .. } => None,
            CapacityPolicy::Drop { expert_capacity, .. } => Some(expert_capacity),
        }
    }

    pub fn drop_counts(&self) -> u64 {
        match *self {
            CapacityPolicy::NoDrop { drop_counts } | CapacityPolicy::Drop { drop_counts, .. } => drop_counts,
        }
    }
}

/// mkMoeOptions_t.activation codes.
pub const MK_MOE_ACT_NONE: i32 = 0;
pub const MK_MOE_ACT_SILU: i32 = 1;
pub const MK_MOE_ACT_GELU: i32 = 2;

/// What the dispatch's GEMM writes (mkMoeOptions_t.activation): X · W1ᵀ, or with a gated
/// w1 [E_local, 2·F, H] (Megatron's fused fc1: per expert F gate rows, then F up rows)
/// act(X · W_gateᵀ) · (X · W_upᵀ), formed in the epilogue (kernels/moe.cu GatedEpilogue).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    None,
    /// SwiGLU: silu(g) = g · sigmoid(g).
    Silu,
    /// GeGLU: gelu(g) = g · Φ(g), the erf form (torch.nn.functional.gelu's default).
    Gelu,
}

impl Activation {
    /// The activation a C caller's `activation` and `reserved` ask for.
    pub fn from_raw(code: i32, reserved: i32) -> Result<Activation> {
        crate::ensure_arg!(
            reserved == 0,
            "options->reserved = {reserved} must be 0 (initialise with MK_MOE_OPTIONS_INITIALIZER)"
        );
        match code {
            MK_MOE_ACT_NONE => Ok(Activation::None),
            MK_MOE_ACT_SILU => Ok(Activation::Silu),
            MK_MOE_ACT_GELU => Ok(Activation::Gelu),
            other => Err(MkError::invalid_argument(format!(
                "options->activation = {other} is none of MK_MOE_ACT_NONE ({MK_MOE_ACT_NONE}), MK_MOE_ACT_SILU \
                 ({MK_MOE_ACT_SILU}), MK_MOE_ACT_GELU ({MK_MOE_ACT_GELU})"
            ))),
        }
    }

    /// MoeParams::activation.
    pub fn code(self) -> i32 {
        match self {
            Activation::None => MK_MOE_ACT_NONE,
            Activation::Silu => MK_MOE_ACT_SILU,
            Activation::Gelu => MK_MOE_ACT_GELU,
        }
    }

    /// Whether w1 is the gated [E_local, 2·F, H] weight.
    pub fn gated(self) -> bool {
        self != Activation::None
    }

    /// Rows of w1 per local expert: F, or 2·F gated.
    pub fn w1_rows(self, ffn: usize) -> usize {
        if self.gated() {
            2 * ffn
        } else {
            ffn
        }
    }
}

/// The gated weight's sizes: its E_local · 2·F rows index the B tensor map and the
/// kernel's row arithmetic in int32.
pub fn validate_activation(d: &MoeDims, activation: Activation) -> Result<()> {
    let rows = d.experts_local().checked_mul(activation.w1_rows(d.ffn));
    crate::ensure_arg!(
        rows.is_some_and(|r| r < i32::MAX as usize),
        "E_local · 2·ffn = {} · {} rows of a gated w1 must stay below 2^31",
        d.experts_local(),
        2 * d.ffn
    );
    Ok(())
}

/// The gated dispatch's tile: 256 accumulator columns, 128 gate and 128 up, so an output
/// tile of 128 columns covers any F (a multiple of 128) and stores two whole 64-column boxes.
pub const GATED_BN: usize = 256;

/// The w1 rule a driver-reported allocation lets the host check: `w1` (`w1_bytes` needed)
/// must end inside the allocation [base, base + size) that holds it. `range` None: the
/// driver does not know the extent (nothing to check). Memory suballocated from a larger
/// block (PyTorch's caching allocator) is checked against that block only.
pub fn check_w1_extent(
    w1: u64,
    w1_bytes: u64,
    range: Option<(u64, u64)>,
    activation: Activation,
    ffn: usize,
) -> Result<()> {
    let Some((base, size)) = range else { return Ok(()) };
    let end = base.saturating_add(size);
    crate::ensure_arg!(
        w1 >= base && w1.checked_add(w1_bytes).is_some_and(|e| e <= end),
        "w1 = {w1:#x}: its allocation ends {} bytes after it, fewer than the {w1_bytes} bytes of E_local · {} · hidden \
         elements{}",
        end.saturating_sub(w1),
        if activation.gated() { "2·ffn" } else { "ffn" },
        if activation.gated() {
            format!(
                " a gated activation reads (w1 [E_local, 2·ffn, hidden], gate rows then up rows per expert, ffn = {ffn}; \
                 a plain [E_local, ffn, hidden] weight is half of it)"
            )
        } else {
            String::new()
        }
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn validate_dispatch(
    x: u64,
    topk_idx: u64,
    w1: u64,
    y: u64,
    recv_counts: u64,
    layout: u64,
    dims: MoeDims,
    dtype: RawDataType,
) -> Result<DispatchArgs> {
    let dtype = mkDataType_t::gemm_type_from_raw(dtype, "mkMoeDispatchGemm")?;
    validate_dims(&dims)?;
    let has_tokens = dims.tokens > 0;
    check_ptr(x, "x", 16, has_tokens)?;
    check_ptr(topk_idx, "topkIdx", 4, has_tokens)?;
    check_ptr(w1, "w1", 16, true)?;
    check_ptr(y, "y", 16, true)?;
    check_ptr(recv_counts, "recvCounts", 4, true)?;
    check_ptr(layout, "layout", 16, true)?;
    Ok(DispatchArgs {
        x,
        topk_idx,
        w1,
        y,
        recv_counts,
        layout,
        dims,
        dtype,
        policy: CapacityPolicy::NoDrop { drop_counts: 0 },
        activation: Activation::None,
        trace: 0,
    })
}

/// A validated mkMoeGemmCombine call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CombineArgs {
    pub y_act: u64,
    pub w2: u64,
    pub topk_weights: u64,
    pub layout: u64,
    pub out: u64,
    pub dims: MoeDims,
    pub dtype: mkDataType_t,
    /// Per-CTA timing buffer for `mkbench moe --trace` (kernels/common/trace.cuh), else 0.
    pub trace: u64,
}

#[allow(clippy::too_many_arguments)]
pub fn validate_combine(
    y_act: u64,
    w2: u64,
    topk_weights: u64,
    layout: u64,
    out: u64,
    dims: MoeDims,
    dtype: RawDataType,
) -> Result<CombineArgs> {
    let dtype = mkDataType_t::gemm_type_from_raw(dtype, "mkMoeGemmCombine")?;
    validate_dims(&dims)?;
    let has_tokens = dims.tokens > 0;
    check_ptr(y_act, "yAct", 16, true)?;
    check_ptr(w2, "w2", 16, true)?;
    check_ptr(topk_weights, "topkWeights", 4, has_tokens)?;
    check_ptr(layout, "layout", 16, true)?;
    check_ptr(out, "out", 16, has_tokens)?;
    Ok(CombineArgs { y_act, w2, topk_weights, layout, out, dims, dtype, trace: 0 })
}

/// Bytes/s one communication CTA moves (16-byte vector copies to or from a peer).
pub const COMM_BYTES_PER_CTA_PER_S: f64 = 25e9;

/// CTAs of a persistent MoE kernel: compute (GEMM tiles) and communication (send or pull).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RolePlan {
    pub compute_ctas: u32,
    pub comm_ctas: u32,
}

/// Dispatch: every CTA runs GEMM tiles; the last one first computes the layout (the prep,
/// ~150 us at 4 ranks, while every CTA waits for the layout anyway), and the token rows
/// are sent by the three idle warps of every GEMM CTA's producer warpgroup
/// (`send_by_gemm_ctas`), so that no SM waits idle once the rows are out (dedicated
/// senders sit idle for 75% of the kernel at 4 ranks; a prep CTA that only sends after the
/// layout leaves the GEMM grid - 1 CTAs, 15 of 16 at 4 ranks, where the GEMM is ~90 % of
/// the kernel and the rows are out after a third of it). With MK_COMM_SMS = c, c communication CTAs compute the layout and send.
///
/// Combine: no communication CTAs unless MK_COMM_SMS asks for them: every CTA runs GEMM
/// tiles and then, with its consumer warps, pulls and sums its share of the output (the
/// GEMM keeps every SM; the pull overlaps the GEMM's last wave). Dedicated pull CTAs
/// spend the whole GEMM waiting, and their polling slows the GEMM beside them (benches/results/2026-12-02-moe-time-split.md).
pub fn plan_roles_for(
    dir: Direction,
    bytes: f64,
    gemm_flops: f64,
    grid: u32,
    comm_override: Option<u32>,
) -> Result<RolePlan> {
    match (dir, comm_override) {
        (Direction::Combine, None) => {
            crate::ensure_arg!(grid >= 1, "the MoE combine needs at least 1 CTA");
            Ok(RolePlan { compute_ctas: grid, comm_ctas: 0 })
        }
        (Direction::Dispatch, None) => {
            crate::ensure_arg!(grid >= 1, "the MoE dispatch needs at least 1 CTA");
            Ok(RolePlan { compute_ctas: grid, comm_ctas: 0 })
        }
        _ => plan_roles(bytes, gemm_flops, grid, comm_override),
    }
}

/// Dedicated communication CTAs (MK_COMM_SMS, or sized from the bytes to move and the
/// GEMM's estimated time when `comm_override` is None: moving them takes at most half of
/// it; at least 1, at most half the grid).
pub fn plan_roles(bytes: f64, gemm_flops: f64, grid: u32, comm_override: Option<u32>) -> Result<RolePlan> {
    crate::ensure_arg!(
        grid >= 2,
        "the MoE kernels need at least 2 CTAs (compute and communication); the grid cap is {grid}"
    );
    let comm_ctas = match comm_override {
        Some(c) => {
            crate::ensure_arg!(
                c >= 1 && c < grid,
                "communication CTAs = {c} (MK_COMM_SMS) must be in [1, {grid}) for a grid of {grid} CTAs"
            );
            c
        }
        None => {
            let gemm_s = gemm_flops
                / (crate::ops::common::gpu_model::GEMM_FLOPS_PER_S
                    * (grid as f64 / crate::ops::common::gpu_model::FULL_GPU_SMS).min(1.0));
            let needed = (bytes / (COMM_BYTES_PER_CTA_PER_S * 0.5 * gemm_s.max(1e-9))).ceil() as u32;
            needed.clamp(1, (grid / 2).max(1))
        }
    };
    Ok(RolePlan { compute_ctas: grid - comm_ctas, comm_ctas })
}

/// How the dispatch's prep is split over CTAs (MoeParams::prep_ctas, prep_tokens): CTA c
/// counts tokens [c·tokens_per_cta, (c + 1)·tokens_per_cta) in pass 1 and writes their rows
/// and send-list entries in pass 2; CTA 0 also exchanges the counts and builds the tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrepSplit {
    pub ctas: usize,
    pub tokens_per_cta: usize,
}

/// The prep's split: one pass over a CTA's tokens costs about as much for 1 token per
/// thread as for fewer (its loads' latency), so a CTA takes one thread's worth per thread
/// (`threads` tokens) and the grid's CTAs share the rest. Their per-expert counts
/// ([ctas][E], then the column totals [E] and this rank's offsets [E]) live in the
/// count-exchange area after the exchanged counts ([nranks][E]), which bounds the CTAs
/// when E is large; one CTA always fits (E ≤ MAX_EXPERTS, nranks ≤ MK_MAX_PEERS).
pub fn prep_split(tokens: usize, experts: usize, nranks: usize, grid: usize, threads: usize) -> PrepSplit {
    let fit = (COUNTS_BYTES / 4 / experts.max(1)).saturating_sub(nranks + 2);
    let wanted = tokens.div_ceil(threads.max(1));
    let ctas = wanted.min(grid).min(fit).max(1);
    let tokens_per_cta = tokens.div_ceil(ctas).max(1);
    PrepSplit { ctas: tokens.div_ceil(tokens_per_cta).max(1), tokens_per_cta }
}
const _: () = assert!(
    (crate::kernel_abi::MK_MAX_PEERS + 3) * crate::kernel_abi::MOE_MAX_EXPERTS as usize * 4 <= COUNTS_BYTES,
    "the count-exchange area holds every rank's counts and one prep CTA's scratch at the most experts"
);

/// Shared memory the dispatch's prep uses (kernels/moe.cu `prep`, and `prep_tables` in CTA 0).
pub fn prep_smem_bytes(d: &MoeDims) -> usize {
    let e = d.experts;
    (2 * WARPS * e + e + d.nranks * e + e + d.experts_local() + 1) * 4
}

/// The raster group cap (MoeParams::group_m): m-blocks of one group, which share one wave's
/// B tiles. The engine's balance of one wave's A and B rows (g·BM ≈ (ctas/g)·BN: 5 at 15
/// CTAs and BN 256, 6 at 16). The kernels cut groups at expert runs (`moe_tile`), so an
/// expert of up to g blocks (4.4 at 4 ranks, T 4096, k 8, E 256) is one group and shares
/// each B tile in one wave; a larger one is cut into balanced groups of at most g (a whole
/// hot expert in one group would stream its A blocks once per column tile: A of the group
/// no longer fits the L2 share).
pub fn group_m(d: &MoeDims, bn: usize, compute_ctas: usize) -> usize {
    let rows_est = (d.tokens * d.top_k).max(1);
    engine::raster_group(
        d.capacity.div_ceil(ROW_BLOCK).min(rows_est.div_ceil(ROW_BLOCK) + d.experts_local()),
        bn,
        compute_ctas,
    )
}

/// Send lists (q = local expert · n + step, kernels/moe.cu `prep`) that every warp of the
/// dispatch's GEMM CTAs sends before the GEMM (`Tuning::moe_burst`; MoeParams::burst_lists): the
/// local experts whose blocks the first wave of tiles covers (expert-major order, at the
/// expected rows per expert of uniform routing), plus one. The side warps alone (3 per CTA,
/// 4 vectors in flight per lane) take ~150-200 us to get the first experts' rows out at 4
/// ranks while every GEMM CTA waits for them (a trace); all 12 warps of a CTA,
/// with 8 in flight, send them ~4x faster and are idle until then anyway.
pub fn burst_lists(d: &MoeDims, compute_ctas: usize, tiles_n: usize) -> usize {
    let rows_per_expert = (d.tokens * d.top_k * d.nranks).div_ceil(d.experts.max(1)).max(1);
    let blocks_per_expert = rows_per_expert.div_ceil(ROW_BLOCK);
    let first_wave_blocks = compute_ctas.div_ceil(tiles_n.max(1));
    let experts = first_wave_blocks.div_ceil(blocks_per_expert) + 1;
    (experts * d.nranks).min(d.experts)
}

/// Whether the dispatch bursts (`Tuning::moe_burst`: forced on or off, or auto). Auto bursts at 4
/// ranks and more. Measured (benches/results/2026-12-03-moe-burst-early-sums-attention.md; one H200, T 4096, DeepSeek-V3-like sizes, two
/// GPU rounds): 4 ranks 11.3-11.8 ms with the burst against 12.05-12.08 without; 2 ranks
/// 6.75-6.90 ms against 6.27-6.28 without — at 2 ranks the first wave's waits are short anyway (45 us per
/// CTA), and all 32 CTAs' 12 warps grabbing one 8-row chunk each overshoot the first lists
/// 4x (384 chunks for 96), which holds every CTA's GEMM back.
pub fn burst_for(forced: Option<bool>, nranks: usize) -> bool {
    forced.unwrap_or(nranks >= 4)
}

/// Column tiles per band for `tiles_n` column tiles and `bands` requested: the most bands
/// up to `bands` that divide `tiles_n` (every band the same width).
pub fn band_width(tiles_n: usize, bands: usize) -> usize {
    let b = (1..=bands.clamp(1, tiles_n.max(1))).rev().find(|b| tiles_n % b == 0).unwrap_or(1);
    tiles_n.max(1) / b
}

/// The MoE kernel of a direction for `dtype` and tile width `bn` (MK_MOE_ENTRY lines).
pub fn kernel(dir: Direction, dtype: impl Element, bn: usize) -> Result<Kernel> {
    let (op, direction) = match dir {
        Direction::Dispatch => ("mkMoeDispatchGemm", "dispatch"),
        Direction::Combine => ("mkMoeGemmCombine", "combine"),
    };
    kernels::choose(op, dtype.element(), "MK_MOE_ENTRY", &[Arg::Text(direction), Arg::Element, Arg::Int(bn)])
}

/// The gated dispatch's kernel for `dtype` and tile width `bn` (`dispatch_gated` lines).
pub fn gated_dispatch_kernel(dtype: impl Element, bn: usize) -> Result<Kernel> {
    kernels::choose(
        "mkMoeDispatchGemmWithOptions",
        dtype.element(),
        "MK_MOE_ENTRY",
        &[Arg::Text("dispatch_gated"), Arg::Element, Arg::Int(bn)],
    )
}

/// The m-block tables the dispatch's prep writes into the layout buffer (kernels/moe.cu
/// `prep`), for `rank`'s receive buffer; host mirror for tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockTables {
    /// Per block: local expert.
    pub expert: Vec<usize>,
    /// Per block: bit s = the block holds rows of rank s.
    pub srcmask: Vec<u32>,
    /// Per block: the order key (smaller first).
    pub key: Vec<usize>,
    /// Order positions -> block (a permutation).
    pub order: Vec<usize>,
    /// Per block: (first order position, length) of its (key, expert) run.
    pub run: Vec<(usize, usize)>,
    /// Per block: (first block, blocks) of its expert's segment.
    pub seg: Vec<(usize, usize)>,
    /// Per block: rows in use (1..=128; the GEMM skips a 64-row slab past them).
    pub rows: Vec<usize>,
}

/// The order is the receive layout's own (expert-major): one key, and each expert's
/// blocks one run, so an expert's blocks share its weight tiles in L2.
pub fn block_tables(s: &MoeShape, routing: &[Vec<i32>], rank: usize) -> Result<BlockTables> {
    let (layout, _) = receive_layout(s, routing, rank)?;
    let (mut expert, mut srcmask, mut seg, mut block_rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (le, rows) in layout.iter().enumerate() {
        let first = expert.len();
        let nb = rows.len().div_ceil(ROW_BLOCK);
        for b in 0..nb {
            expert.push(le);
            seg.push((first, nb));
            block_rows.push((rows.len() - b * ROW_BLOCK).min(ROW_BLOCK));
            srcmask.push(
                rows[b * ROW_BLOCK..rows.len().min((b + 1) * ROW_BLOCK)].iter().fold(0u32, |m, r| m | 1 << r.source),
            );
        }
    }
    let key = vec![0; srcmask.len()];
    let mut order: Vec<usize> = (0..expert.len()).collect();
    order.sort_by_key(|&b| (key[b], b));
    let mut run = vec![(0, 0); expert.len()];
    let mut p = 0;
    while p < order.len() {
        let same = |q: usize| key[order[q]] == key[order[p]] && expert[order[q]] == expert[order[p]];
        let end = (p..order.len()).find(|&q| !same(q)).unwrap_or(order.len());
        for q in p..end {
            run[order[q]] = (p, end - p);
        }
        p = end;
    }
    Ok(BlockTables { expert, srcmask, key, order, run, seg, rows: block_rows })
}

/// The dispatch's send list for `rank` (kernels/moe.cu `prep`, read by `send_rows_warp`):
/// lists q = le·nranks + step, for destination d = (rank + step) mod nranks and its local
/// expert le (global e = d·E_local + le), each holding the slots t·k + j of this rank's
/// tokens routed to e in token order (j the first choice naming e; in drop mode the kept
/// ones only). Returns (start of each
/// list, then the total: E + 1 entries; the slots). Senders walk it in order, so each
/// destination receives every source's rows of its expert 0 first, then expert 1, ...
pub fn send_tables(s: &MoeShape, ids: &[i32], rank: usize) -> (Vec<usize>, Vec<usize>) {
    let (n, k) = (s.nranks, s.top_k);
    let el = s.experts / n;
    let mut row0 = Vec::with_capacity(s.experts + 1);
    let mut slots = Vec::new();
    for q in 0..s.experts {
        row0.push(slots.len());
        let e = ((rank + q % n) % n * el + q / n) as i32;
        let mut index = 0;
        for t in 0..ids.len() / k {
            if let Some(j) = ids[t * k..(t + 1) * k].iter().position(|&x| x == e) {
                if kept(s.expert_capacity, index) {
                    slots.push(t * k + j);
                }
                index += 1;
            }
        }
    }
    row0.push(slots.len());
    (row0, slots)
}

/// Tile `t` of the MoE GEMM (kernels/common/moe_raster.cuh `MoeRaster::tile`): (block,
/// n-block within the expert). The GEMM CTAs take tiles by ticket, so `t` is also the
/// ticket of the dynamic schedule: tiles start in this order, whichever CTA computes them.
/// `order` None = identity; `runs` (per block: first order position, length of its run)
/// None = the engine's fixed groups of `group_m`.
pub fn moe_tile(
    order: Option<&[usize]>,
    runs: Option<&[(usize, usize)]>,
    tiles_m: usize,
    tiles_n: usize,
    group_m: usize,
    t: usize,
) -> (usize, usize) {
    moe_tile_banded(order, runs, tiles_m, tiles_n, tiles_n, group_m, t)
}

/// Column bands (kernels/common/moe_raster.cuh `band_locate`): unit `u` of a band-major
/// sequence with `per_col` units per column -> (first column of its band, the band's width,
/// the unit within the band), for bands of `band_w` columns (dividing the column tiles).
pub fn band_locate(per_col: usize, band_w: usize, u: usize) -> (usize, usize, usize) {
    let band = u / (per_col * band_w);
    (band * band_w, band_w, u - band * per_col * band_w)
}

/// `moe_tile` with column bands (MoeParams::band_w: `band_locate`): every tile of band b
/// before band b + 1, each band rastered as `moe_tile` over its columns. The host mirror of
/// `MoeRaster::tile` (tests/schedule_vectors.rs checks the two against each other).
pub fn moe_tile_banded(
    order: Option<&[usize]>,
    runs: Option<&[(usize, usize)]>,
    tiles_m: usize,
    tiles_n: usize,
    band_w: usize,
    group_m: usize,
    t: usize,
) -> (usize, usize) {
    debug_assert!(tiles_n % band_w == 0);
    let at_order = |pos: usize| order.map_or(pos, |o| o[pos]);
    let (col0, band_w, t) = band_locate(tiles_m, band_w, t);
    let (pos, nb) = match runs {
        None => crate::ops::common::schedule::grouped_tile(tiles_m, band_w, group_m, t),
        Some(runs) => {
            let at = t / band_w;
            let (gs, gl) = run_group(runs[at_order(at)], group_m, at);
            let in_group = t - gs * band_w;
            (gs + in_group % gl, in_group / gl)
        }
    };
    (at_order(pos), col0 + nb)
}

/// Item `it` of the combine's pull (kernels/moe.cu `pull_item`): (token, column tile),
/// band-major (`band_locate`), then token, then tile.
pub fn pull_item(tokens: usize, tiles_n: usize, band_w: usize, it: usize) -> (usize, usize) {
    debug_assert!(tiles_n % band_w == 0);
    let (col0, w, r) = band_locate(tokens, band_w, it);
    (r / w, col0 + r % w)
}

/// The raster group (first order position, blocks) holding order position `at` of the run
/// (first position, length): the run cut into ceil(length / group_m) groups, the first
/// length mod groups of them one block longer.
pub fn run_group((rs, len): (usize, usize), group_m: usize, at: usize) -> (usize, usize) {
    let groups = len.div_ceil(group_m);
    let (q, r, o) = (len / groups, len % groups, at - rs);
    let (gs, gl) =
        if o < r * (q + 1) { (o / (q + 1) * (q + 1), q + 1) } else { (r * (q + 1) + (o - r * (q + 1)) / q * q, q) };
    (rs + gs, gl)
}

// ---- plan and launch -------------------------------------------------------------------

/// Which MoE kernel: token dispatch + GEMM, or GEMM + combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Dispatch,
    Combine,
}

impl Direction {
    fn name(self) -> &'static str {
        match self {
            Direction::Dispatch => "mkMoeDispatchGemm",
            Direction::Combine => "mkMoeGemmCombine",
        }
    }
}

/// Everything a MoE launch needs, from the direction, the sizes, the grid and the tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoePlan {
    pub dir: Direction,
    pub roles: RolePlan,
    /// The GEMM's tile width (`tile_width` of its output columns; gated: `GATED_BN`
    /// accumulator columns): with the direction, `gated` and the dtype, it names the kernel.
    pub bn: usize,
    /// The dispatch with a gated w1: each tile's B is BN/2 gate rows and BN/2 up rows, and
    /// `tiles_n` counts tiles over 2·F accumulator columns.
    pub gated: bool,
    pub smem_bytes: usize,
    /// Column tiles of the GEMM, and per column band (`band_width`; all of them: one band).
    pub tiles_n: usize,
    pub band_w: usize,
    /// Raster group cap (`group_m`).
    pub group_m: usize,
    /// Dispatch without MK_COMM_SMS: the GEMM CTAs' idle warps send the rows.
    pub send_by_gemm_ctas: bool,
    /// Send lists every warp sends before the GEMM (`burst_lists`; 0: no burst).
    pub burst_lists: usize,
    /// Where the tables live in the caller's layout buffer.
    pub layout: LayoutOffsets,
    /// The dispatch's prep over CTAs [0, prep.ctas) (combine: none).
    pub prep: PrepSplit,
    /// CTAs launched: compute and communication.
    pub grid: u32,
}

impl MoePlan {
    /// The launch of this plan for `dtype`.
    pub fn kernel_launch(&self, dtype: impl Element) -> Result<KernelLaunch> {
        let kernel =
            if self.gated { gated_dispatch_kernel(dtype, self.bn)? } else { kernel(self.dir, dtype, self.bn)? };
        Ok(KernelLaunch::new(kernel, self.grid, engine::THREADS, self.smem_bytes as u32))
    }
}

/// The grouped GEMM's output columns and contraction: dispatch Y = X·W1ᵀ (F, H), combine
/// Z = Y'·W2ᵀ (H, F).
pub fn gemm_cols(dir: Direction, d: &MoeDims) -> (usize, usize) {
    match dir {
        Direction::Dispatch => (d.ffn, d.hidden),
        Direction::Combine => (d.hidden, d.ffn),
    }
}

/// Plans one call: the role split (`plan_roles_for`: from the bytes each rank sends, its
/// GEMM's estimated FLOPs at uniform routing, the grid cap and MK_COMM_SMS), the tile,
/// bands, raster group and burst (`Tuning::moe_bands`, `Tuning::moe_burst`), and the layout
/// tables. `gemm = false` runs the data movement only (the unfused baselines of mkbench).
/// A gated `activation` (dispatch only) computes 2·F accumulator columns in tiles of
/// `GATED_BN` (gate and up halves) and writes F.
pub fn plan(
    dir: Direction,
    d: &MoeDims,
    grid_ctas: u32,
    comm_override: Option<u32>,
    tuning: &Tuning,
    gemm: bool,
    activation: Activation,
) -> Result<MoePlan> {
    let gated = activation.gated();
    if gated && dir != Direction::Dispatch {
        return Err(MkError::internal(format!("{}: only the dispatch takes a gated weight", dir.name())));
    }
    let (out_cols, inner) = gemm_cols(dir, d);
    // The GEMM's accumulator columns: gated, the gate's and the up projection's.
    let cols = if gated { 2 * out_cols } else { out_cols };
    // The role split weighs bytes against FLOPs before a call's element type is chosen; the
    // tokens move as the engine's operands, so they are counted at the operand size.
    let bytes_moved = (d.tokens * d.top_k * d.hidden * engine::OPERAND_BYTES) as f64;
    let rows_est = (d.tokens * d.top_k).max(1);
    let flops = 2.0 * rows_est as f64 * cols as f64 * inner as f64;
    let roles = plan_roles_for(dir, bytes_moved, flops, grid_ctas, comm_override)?;
    let bn = if gated { GATED_BN } else { tile_width(cols) };
    let smem = engine::smem_bytes(bn, Epilogue::Tma);
    if dir == Direction::Dispatch && prep_smem_bytes(d) > smem {
        return Err(MkError::internal(format!(
            "{}: the prep CTA needs {} bytes of shared memory, the launch has {smem}",
            dir.name(),
            prep_smem_bytes(d)
        )));
    }
    let tiles_n = cols / bn;
    let send_by_gemm_ctas = dir == Direction::Dispatch && comm_override.is_none();
    Ok(MoePlan {
        dir,
        roles,
        bn,
        gated,
        smem_bytes: smem,
        tiles_n,
        band_w: match dir {
            Direction::Dispatch => tiles_n,
            Direction::Combine => band_width(tiles_n, tuning.moe_bands),
        },
        group_m: group_m(d, bn, roles.compute_ctas as usize),
        send_by_gemm_ctas,
        burst_lists: if send_by_gemm_ctas && gemm && burst_for(tuning.moe_burst, d.nranks) {
            burst_lists(d, roles.compute_ctas as usize, tiles_n)
        } else {
            0
        },
        layout: layout_offsets(d.tokens, d.top_k, d.capacity),
        prep: match dir {
            Direction::Dispatch => prep_split(
                d.tokens,
                d.experts,
                d.nranks,
                (roles.compute_ctas + roles.comm_ctas) as usize,
                engine::THREADS as usize,
            ),
            Direction::Combine => PrepSplit { ctas: 0, tokens_per_cta: 0 },
        },
        grid: roles.compute_ctas + roles.comm_ctas,
    })
}

/// A validated call's operands: the GEMM's A [rows, K], B [rows, K] and C [rows, cols]
/// as (pointer, rows, cols), `REGION` standing for this rank's receive buffer / Z in the
/// fused-op region; and the kernel parameters the call itself sets.
struct MoeCall {
    dir: Direction,
    dims: MoeDims,
    dtype: mkDataType_t,
    a: (u64, usize, usize),
    b: (u64, usize, usize),
    c: (u64, usize, usize),
    params: MoeParams,
    gemm: bool,
    activation: Activation,
}

/// The operand pointer standing for this rank's buffer in the fused-op region.
const REGION: u64 = u64::MAX;

/// Byte offsets of the count exchange and of the receive buffer / Z in the fused-op
/// region, and the bytes the op needs there for a receive buffer of elements of `dtype`.
fn region_needed(dims: &MoeDims, dtype: impl Element) -> usize {
    COUNTS_BYTES + dtype.element().bytes_of(dims.capacity * dims.hidden)
}

/// Checks the call against `comm`'s workspace, plans it for the device, launches the plan.
fn run(comm: &Comm, call: MoeCall, stream: sys::CUstream) -> Result<()> {
    comm.check_usable()?;
    let name = call.dir.name();
    crate::ensure_arg!(call.dims.nranks == comm.nranks, "{name}: internal: nranks mismatch");
    let ws = comm.one_node_workspace(name)?;
    let needed = region_needed(&call.dims, call.dtype) as u64;
    if needed > ws.view.op_bytes {
        return Err(MkError::invalid_usage(format!(
            "{name} keeps a receive buffer of recvCapacity·H = {}·{} elements (plus {COUNTS_BYTES} bytes of counts) in the \
             workspace's fused-op region, which holds {} bytes: create the communicator with MK_WORKSPACE_BYTES (or \
             mkConfig_t.workspaceBytes) of at least {needed}",
            call.dims.capacity,
            call.dims.hidden,
            ws.view.op_bytes
        )));
    }
    let _ctx = comm.context.enter()?;
    let grid = DeviceCaps::of(comm)?.grid_cap();
    let p = plan(call.dir, &call.dims, grid, comm.config.comm_ctas, &comm.config.tuning, call.gemm, call.activation)?;
    let region = ws.view.data[comm.rank] + ws.view.data_bytes;
    fused_fence::launch_fenced(comm, &ws.view, None, FusedKernel::Moe, stream, || {
        launch(call, &p, &ws.view, region, stream)
    })
}

/// Launches plan `p` for `call` (the context current) on the workspace `view`, whose
/// fused-op region starts at `region` on this rank.
fn launch(call: MoeCall, p: &MoePlan, view: &WorkspaceView, region: u64, stream: sys::CUstream) -> Result<()> {
    let mut params = call.params;
    let lo = &p.layout;
    params.lay_dest = lo.dest as i32;
    params.lay_row = lo.row as i32;
    params.lay_mb_expert = lo.mb_expert as i32;
    params.lay_mb_order = lo.mb_order as i32;
    params.lay_mb_srcmask = lo.mb_srcmask as i32;
    params.lay_mb_run = lo.mb_run as i32;
    params.lay_mb_seg = lo.mb_seg as i32;
    params.lay_mb_rows = lo.mb_rows as i32;
    params.lay_send = lo.send as i32;
    params.lay_send_row0 = lo.send_row0 as i32;
    params.ws = *view;
    params.counts_offset = view.data_bytes;
    params.buf_offset = view.data_bytes + COUNTS_BYTES as u64;
    params.tiles_n = p.tiles_n as i32;
    params.band_w = p.band_w as i32;
    params.group_m = p.group_m as i32;
    params.compute_ctas = p.roles.compute_ctas as i32;
    params.comm_ctas = p.roles.comm_ctas as i32;
    params.gemm = call.gemm as i32;
    params.send_by_gemm_ctas = p.send_by_gemm_ctas as i32;
    params.burst_lists = p.burst_lists as i32;
    params.prep_ctas = p.prep.ctas as i32;
    params.prep_tokens = p.prep.tokens_per_cta as i32;
    params.activation = call.activation.code();
    let at = |ptr: u64| if ptr == REGION { region + COUNTS_BYTES as u64 } else { ptr };
    let (a, b, c, dtype) = (call.a, call.b, call.c, call.dtype);
    let mut ta = launch::tensor_map(at(a.0), dtype, a.1, a.2, engine::BM, engine::BK)?;
    // Gated: each B tile is two boxes, the gate rows and the up rows (engine.cuh HasSplitB).
    let b_box_rows = if p.gated { p.bn / 2 } else { p.bn };
    let mut tb = launch::tensor_map(at(b.0), dtype, b.1, b.2, b_box_rows, engine::BK)?;
    let mut tc = launch::tensor_map(at(c.0), dtype, c.1, c.2, 64, 64)?;
    let mut kernel_launch = p.kernel_launch(dtype)?;
    if params.trace != 0 {
        // `mkbench --trace`: the twin with the trace hooks (the library's kernel has none).
        kernel_launch.kernel = crate::cuda::kernels::trace_twin(kernel_launch.kernel)?;
    }
    let mut kernel_params: [*mut c_void; 4] = [
        (&mut ta as *mut sys::CUtensorMap).cast(),
        (&mut tb as *mut sys::CUtensorMap).cast(),
        (&mut tc as *mut sys::CUtensorMap).cast(),
        (&mut params as *mut MoeParams).cast(),
    ];
    // SAFETY: the parameters match the kernel (3 tensor maps, MoeParams); the buffers were
    // checked to be device memory of this device.
    unsafe { kernel_launch.launch(stream, &mut kernel_params, Some(call.dir.name())) }
}

/// The parameters a call's sizes and layout buffer set (the plan sets the rest).
fn base_params(dims: &MoeDims, layout: u64) -> MoeParams {
    MoeParams {
        layout,
        tokens: dims.tokens as i32,
        hidden: dims.hidden as i32,
        ffn: dims.ffn as i32,
        top_k: dims.top_k as i32,
        experts: dims.experts as i32,
        experts_local: dims.experts_local() as i32,
        capacity: dims.capacity as i32,
        ..Default::default()
    }
}

fn check_pointers(comm: &Comm, ptrs: &[(u64, &str)]) -> Result<()> {
    let _ctx = comm.context.enter()?;
    for &(p, name) in ptrs {
        if p != 0 {
            crate::cuda::pointer::check_device_pointer(p, comm.context.device, name)?;
        }
    }
    Ok(())
}

/// mkMoeDispatchGemm on `comm` (stream-ordered, no host sync). `gemm = false` moves the
/// tokens only (the benchmark's unfused baseline then runs the GEMMs itself).
pub fn dispatch_gemm(comm: &Comm, a: &DispatchArgs, gemm: bool, stream: sys::CUstream) -> Result<()> {
    let d = a.dims;
    crate::ensure_arg!(
        d.nranks == comm.nranks,
        "internal: dims for {} ranks on a communicator of {}",
        d.nranks,
        comm.nranks
    );
    check_pointers(
        comm,
        &[
            (a.x, "x"),
            (a.topk_idx, "topkIdx"),
            (a.w1, "w1"),
            (a.y, "y"),
            (a.recv_counts, "recvCounts"),
            (a.layout, "layout"),
            (a.policy.drop_counts(), "dropCounts"),
        ],
    )?;
    let el = d.experts_local();
    let w1_rows = el * a.activation.w1_rows(d.ffn);
    if a.activation.gated() {
        let w1_bytes = (w1_rows * d.hidden * 2) as u64;
        let _ctx = comm.context.enter()?;
        check_w1_extent(a.w1, w1_bytes, allocation_range(a.w1), a.activation, d.ffn)?;
    }
    let mut params = base_params(&d, a.layout);
    params.x = a.x;
    params.topk_idx = a.topk_idx;
    params.recv_counts = a.recv_counts;
    params.expert_capacity = a.policy.expert_capacity().map_or(0, |c| c as i32);
    params.drop_counts = a.policy.drop_counts();
    params.trace = a.trace;
    run(
        comm,
        MoeCall {
            dir: Direction::Dispatch,
            dims: d,
            dtype: a.dtype,
            a: (REGION, d.capacity, d.hidden),
            b: (a.w1, w1_rows, d.hidden),
            c: (a.y, d.capacity, d.ffn),
            params,
            gemm,
            activation: a.activation,
        },
        stream,
    )
}

/// mkMoeGemmCombine on `comm`. `gemm = false`: Z is already in the fused-op region (the
/// benchmark's unfused baseline wrote it with separate GEMM launches); only pull and sum.
pub fn gemm_combine(comm: &Comm, a: &CombineArgs, gemm: bool, stream: sys::CUstream) -> Result<()> {
    let d = a.dims;
    crate::ensure_arg!(
        d.nranks == comm.nranks,
        "internal: dims for {} ranks on a communicator of {}",
        d.nranks,
        comm.nranks
    );
    check_pointers(
        comm,
        &[(a.y_act, "yAct"), (a.w2, "w2"), (a.topk_weights, "topkWeights"), (a.layout, "layout"), (a.out, "out")],
    )?;
    let mut params = base_params(&d, a.layout);
    params.topk_weights = a.topk_weights;
    params.out = a.out;
    params.trace = a.trace;
    let el = d.experts_local();
    run(
        comm,
        MoeCall {
            dir: Direction::Combine,
            dims: d,
            dtype: a.dtype,
            a: (a.y_act, d.capacity, d.ffn),
            b: (a.w2, el * d.hidden, d.ffn),
            c: (REGION, d.capacity, d.hidden),
            params,
            gemm,
            activation: Activation::None,
        },
        stream,
    )
}

/// The allocation holding device pointer `ptr`, (base, bytes), as the driver reports it
/// (a context current); None when it does not know (then nothing can be checked).
fn allocation_range(ptr: u64) -> Option<(u64, u64)> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: two out-parameters of the types the driver documents.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    (r == sys::CUresult::CUDA_SUCCESS && size > 0).then_some((base, size as u64))
}

/// Device pointer of this rank's receive buffer / Z in the fused-op region (benchmarks).
pub fn region_buffer(comm: &Comm) -> Option<u64> {
    comm.workspace.as_ref().map(|w| w.view.data[w.view.rank as usize] + w.view.data_bytes + COUNTS_BYTES as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(tokens: usize, top_k: usize, experts: usize, nranks: usize) -> MoeShape {
        MoeShape::new(tokens, top_k, experts, nranks)
    }

    #[test]
    fn rules_are_named() {
        assert!(validate(&shape(4, 2, 6, 4)).unwrap_err().message.contains("multiple of nranks"));
        assert!(validate(&shape(4, 0, 8, 4)).is_err());
        let s = shape(1, 1, 8, 2);
        assert!(receive_layout(&s, &[vec![8], vec![0]], 0).unwrap_err().message.contains("outside [0, 8)"));
        let s2 = shape(1, 2, 8, 2);
        assert!(receive_layout(&s2, &[vec![0, 1, 2], vec![0, 1]], 0)
            .unwrap_err()
            .message
            .contains("not a multiple of k = 2"));
        assert_eq!(
            rows_needed(&receive_layout(&s2, &[vec![0, 1, 2, 3], vec![]], 0).unwrap().0),
            4,
            "ranks may hold different T"
        );
    }

    #[test]
    fn every_routed_pair_lands_once_on_its_owner_and_tokens_travel_once() {
        // 3 ranks, 6 experts (2 each), k = 2, skewed: expert 0 takes most, -1 holes, a
        // token routed to two experts of the same rank.
        let s = shape(4, 2, 6, 3);
        let routing =
            vec![vec![0, 1, 0, -1, 0, 5, -1, -1], vec![0, 2, 0, 3, 1, 0, 4, 4], vec![-1, -1, 0, 1, 5, 4, 0, 2]];
        let mut pairs = 0;
        let mut wire = 0;
        for r in 0..3 {
            let (layout, tokens_from) = receive_layout(&s, &routing, r).unwrap();
            for (le, rows) in layout.iter().enumerate() {
                for w in rows.windows(2) {
                    assert!((w[0].source, w[0].token) < (w[1].source, w[1].token), "ordered by source, then token");
                }
                for row in rows {
                    assert_eq!(row.local_expert, le);
                    let ids = &routing[row.source][row.token * 2..row.token * 2 + 2];
                    assert!(ids.contains(&((r * 2 + le) as i32)));
                }
            }
            pairs += rows_needed(&layout);
            wire += tokens_from.iter().sum::<usize>();
        }
        // Distinct (token, expert) pairs with an expert: count them directly.
        let direct: usize = routing
            .iter()
            .map(|ids| {
                ids.chunks(2)
                    .map(|c| {
                        let mut v: Vec<_> = c.iter().filter(|&&e| e >= 0).collect();
                        v.sort();
                        v.dedup();
                        v.len()
                    })
                    .sum::<usize>()
            })
            .sum();
        assert_eq!(pairs, direct);
        // Rank 1's token 3 goes to experts 4 and 4 (one rank, one expert): one row, one send.
        let (layout2, _) = receive_layout(&s, &routing, 2).unwrap();
        assert_eq!(layout2[0].iter().filter(|row| row.source == 1 && row.token == 3).count(), 1);
        assert!(wire < pairs, "tokens for two experts of one rank travel once");
    }

    #[test]
    fn the_drop_rule_keeps_each_sources_first_rows_of_an_expert() {
        // 2 ranks, 4 experts (2 each), k = 2, drop mode at 2 rows per (source, expert).
        // Rank 0's rows of expert 0: tokens 0 (listed twice: one row), 1, 3, 4, 5.
        let r0 = vec![0, 0, 0, 1, 1, -1, 0, 3, 0, 2, 0, -1];
        // Rank 1's rows of expert 0: tokens 0, 1, 2.
        let r1 = vec![0, 1, 2, 0, 0, 3];
        let routing = vec![r0.clone(), r1.clone()];
        let capped = |tokens| MoeShape { expert_capacity: Some(2), ..shape(tokens, 2, 4, 2) };
        let (layout, _) = receive_layout(&capped(6), &routing, 0).unwrap();
        let rows = |le: usize| layout[le].iter().map(|r| (r.source, r.token)).collect::<Vec<_>>();
        assert_eq!(rows(0), vec![(0, 0), (0, 1), (1, 0), (1, 1)], "the first two of each source, token order");
        assert_eq!(rows(1), vec![(0, 1), (0, 2), (1, 0)], "under the cap: every row");
        assert_eq!(drop_counts(&capped(6), &r0), vec![3, 0, 0, 0]);
        assert_eq!(drop_counts(&capped(3), &r1), vec![1, 0, 0, 0]);
        assert_eq!(drop_counts(&shape(6, 2, 4, 2), &r0), vec![0; 4], "no-drop mode drops nothing");
        // A dropped choice has no slot; the repeated choice of token 0 shares its row.
        let dl = device_layout(&capped(6), &routing, 0).unwrap();
        assert_eq!(dl.slots[0], dl.slots[1]);
        assert_eq!((dl.slots[6], dl.slots[8], dl.slots[10]), (None, None, None), "tokens 3, 4, 5 of expert 0");
        assert_eq!(dl.slots[7], Some((1, 128)), "token 3's expert 3 is kept: rank 1's second expert");
        assert_eq!(dl.recv_counts, vec![4, 3]);
        // The send list holds the kept rows only, and the block tables count them.
        let (row0, slots) = send_tables(&capped(6), &r0, 0);
        assert_eq!(&slots[row0[0]..row0[1]], &[0, 2], "expert 0 from rank 0: tokens 0 and 1");
        assert_eq!(block_tables(&capped(6), &routing, 0).unwrap().rows, vec![4, 3]);
        // The cap bounds what each expert receives: nranks · cap rows.
        let routing = routing_for(300, 4, 8, 2, 5);
        for rank in 0..2 {
            let s = MoeShape { expert_capacity: Some(7), ..shape(300, 4, 8, 2) };
            let dl = device_layout(&s, &routing, rank).unwrap();
            assert!(dl.recv_counts.iter().all(|&c| c == 14), "{:?}", dl.recv_counts);
            assert_eq!(dl.slots.iter().filter(|s| s.is_some()).count(), 8 * 7, "7 kept rows per expert");
            // routing_for picks distinct experts: each of the 1200 choices is kept or dropped.
            assert_eq!(drop_counts(&s, &routing[rank]).iter().sum::<usize>() + 8 * 7, 300 * 4);
        }
    }

    #[test]
    fn capacity_policy_rules_are_named() {
        let p = 0x1000;
        let err = |code, cap, counts| CapacityPolicy::from_raw(code, cap, counts).unwrap_err().message;
        assert_eq!(CapacityPolicy::from_raw(MK_MOE_NO_DROP, 0, 0).unwrap(), CapacityPolicy::NoDrop { drop_counts: 0 });
        assert_eq!(CapacityPolicy::from_raw(MK_MOE_NO_DROP, 0, p).unwrap().drop_counts(), p);
        assert_eq!(CapacityPolicy::from_raw(MK_MOE_DROP, 9, p).unwrap().expert_capacity(), Some(9));
        assert!(err(MK_MOE_DROP, 0, p).contains("expertCapacity = 0: drop mode needs"));
        assert!(err(MK_MOE_DROP, -3, p).contains("expertCapacity = -3"));
        assert!(err(MK_MOE_DROP, 1 << 31, p).contains("in [1, 2^31)"));
        assert!(err(MK_MOE_DROP, 9, 0).contains("dropCounts is NULL"));
        assert!(err(MK_MOE_DROP, 9, p + 2).contains("dropCounts = 0x1002 is not 4-byte aligned"));
        assert!(err(MK_MOE_NO_DROP, 9, p).contains("is set but options->capacityPolicy is MK_MOE_NO_DROP"));
        for code in [2, -1, i32::MAX] {
            assert!(err(code, 9, p).contains(&format!("options->capacityPolicy = {code} is neither")));
        }
    }

    #[test]
    fn activation_rules_are_named() {
        assert_eq!(Activation::from_raw(MK_MOE_ACT_NONE, 0).unwrap(), Activation::None);
        assert_eq!(Activation::from_raw(MK_MOE_ACT_SILU, 0).unwrap(), Activation::Silu);
        assert_eq!(Activation::from_raw(MK_MOE_ACT_GELU, 0).unwrap(), Activation::Gelu);
        for a in [Activation::None, Activation::Silu, Activation::Gelu] {
            assert_eq!(Activation::from_raw(a.code(), 0).unwrap(), a);
        }
        for code in [3, -1, i32::MAX] {
            let e = Activation::from_raw(code, 0).unwrap_err().message;
            assert!(e.contains(&format!("options->activation = {code} is none of MK_MOE_ACT_NONE")), "{e}");
        }
        let e = Activation::from_raw(MK_MOE_ACT_SILU, 5).unwrap_err().message;
        assert!(e.contains("options->reserved = 5 must be 0"), "{e}");
        assert_eq!((Activation::None.w1_rows(768), Activation::Gelu.w1_rows(768)), (768, 1536));
        // The gated weight's rows stay in int32.
        let d = MoeDims { tokens: 1, hidden: 128, ffn: 1 << 23, top_k: 1, experts: 128, capacity: 128, nranks: 1 };
        assert!(validate_activation(&d, Activation::None).is_ok());
        let e = validate_activation(&d, Activation::Silu).unwrap_err().message;
        assert!(e.contains("E_local · 2·ffn = 128 · 16777216 rows"), "{e}");
        assert!(validate_activation(&MoeDims { ffn: 1 << 22, ..d }, Activation::Silu).is_ok());
    }

    #[test]
    fn a_gated_w1_must_fit_its_allocation() {
        let (ffn, hidden, el) = (256usize, 128usize, 4usize);
        let gated_bytes = (el * 2 * ffn * hidden * 2) as u64;
        let w1 = 0x10_0000u64;
        // A gated weight in an allocation of exactly its size, or in a larger block.
        assert!(check_w1_extent(w1, gated_bytes, Some((w1, gated_bytes)), Activation::Silu, ffn).is_ok());
        assert!(check_w1_extent(w1 + 512, gated_bytes, Some((w1, gated_bytes + 512)), Activation::Gelu, ffn).is_ok());
        // The driver does not know the extent: nothing to check.
        assert!(check_w1_extent(w1, gated_bytes, None, Activation::Silu, ffn).is_ok());
        // A plain [E_local, ffn, hidden] weight passed as gated: half the bytes.
        let e =
            check_w1_extent(w1, gated_bytes, Some((w1, gated_bytes / 2)), Activation::Silu, ffn).unwrap_err().message;
        assert!(
            e.contains(&format!("ends {} bytes after it, fewer than the {gated_bytes} bytes", gated_bytes / 2))
                && e.contains("w1 [E_local, 2·ffn, hidden]")
                && e.contains("ffn = 256"),
            "{e}"
        );
        // One byte short, and a pointer past its allocation's end.
        assert!(check_w1_extent(w1, gated_bytes, Some((w1, gated_bytes - 1)), Activation::Gelu, ffn).is_err());
        assert!(check_w1_extent(w1, 16, Some((0, 8)), Activation::Silu, ffn).is_err());
    }

    #[test]
    fn experts_without_tokens_have_empty_groups() {
        let s = shape(3, 1, 8, 2);
        let (layout, tokens_from) = receive_layout(&s, &[vec![0, 0, 0], vec![0, -1, 1]], 1).unwrap();
        assert!(layout.iter().all(Vec::is_empty));
        assert_eq!(tokens_from, vec![0, 0]);
    }

    fn dims(
        tokens: usize,
        hidden: usize,
        ffn: usize,
        top_k: usize,
        experts: usize,
        capacity: usize,
        nranks: usize,
    ) -> MoeDims {
        MoeDims { tokens, hidden, ffn, top_k, experts, capacity, nranks }
    }

    #[test]
    fn every_plan_launches_a_built_kernel_on_whole_bands() {
        let tunings = [
            Tuning::default(),
            Tuning { moe_bands: 1, ..Tuning::default() },
            Tuning { moe_bands: 7, moe_burst: Some(true), ..Tuning::default() },
            Tuning { moe_burst: Some(false), ..Tuning::default() },
        ];
        let (mut planned, mut refused) = (0, 0);
        for dir in [Direction::Dispatch, Direction::Combine] {
            for nranks in [1, 2, 4, 8] {
                for (tokens, top_k, experts) in [(0, 1, 8), (1, 1, 8), (128, 2, 16), (4096, 8, 256), (512, 6, 64)] {
                    for (hidden, ffn) in [(128, 128), (7168, 2048), (4096, 1408), (2048, 768)] {
                        for capacity in [128, 4096, 40960] {
                            for (grid, comm) in
                                [(132, None), (132, Some(4)), (33, Some(1)), (16, None), (1, None), (8, Some(8))]
                            {
                                for tuning in &tunings {
                                    for (gemm, act) in [
                                        (true, Activation::None),
                                        (false, Activation::None),
                                        (true, Activation::Silu),
                                        (true, Activation::Gelu),
                                    ] {
                                        let d = MoeDims { tokens, hidden, ffn, top_k, experts, capacity, nranks };
                                        let planned_call = plan(dir, &d, grid, comm, tuning, gemm, act);
                                        if act.gated() && dir == Direction::Combine {
                                            assert!(planned_call.is_err(), "the combine takes no gated weight");
                                            continue;
                                        }
                                        let Ok(p) = planned_call else {
                                            refused += 1;
                                            continue;
                                        };
                                        planned += 1;
                                        // Gated: gate and up accumulator columns, in GATED_BN tiles.
                                        let cols = act.w1_rows(gemm_cols(dir, &d).0);
                                        assert_eq!(p.roles.compute_ctas + p.roles.comm_ctas, grid, "{dir:?} {d:?}");
                                        assert_eq!((p.bn * p.tiles_n, p.tiles_n % p.band_w), (cols, 0));
                                        assert_eq!(p.gated, act.gated());
                                        assert!(!p.gated || p.bn == GATED_BN);
                                        assert!(
                                            dir == Direction::Combine || p.band_w == p.tiles_n,
                                            "dispatch: one band"
                                        );
                                        assert_eq!(p.send_by_gemm_ctas, dir == Direction::Dispatch && comm.is_none());
                                        assert!(
                                            p.burst_lists <= experts
                                                && (p.burst_lists == 0 || (gemm && p.send_by_gemm_ctas))
                                        );
                                        assert!(p.group_m >= 1);
                                        let l = p.kernel_launch(mkDataType_t::mkFloat16).unwrap();
                                        assert_eq!((l.grid, l.block, l.smem_bytes), (grid, 384, p.smem_bytes as u32));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(planned > 10_000 && refused > 100, "{planned} planned, {refused} refused");
    }

    /// Representative plans at DeepSeek-V3-like sizes (T 4096, H 7168, F 2048, k 8, E 256).
    #[test]
    fn the_plan_picks_roles_tiles_bands_and_burst() {
        let t = Tuning::default();
        let d = dims(4096, 7168, 2048, 8, 256, 40960, 4);
        // Dispatch on 33 CTAs: every CTA computes and sends, BN 256 over F, one band, the
        // group sqrt(33·256/128) ≈ 8; the burst at 4 ranks: 512 rows (4 blocks) per expert
        // at uniform routing, a first wave of 5 blocks, so 3 experts' lists to 4 ranks.
        let p = plan(Direction::Dispatch, &d, 33, None, &t, true, Activation::None).unwrap();
        assert_eq!((p.roles, p.bn, p.tiles_n, p.band_w), (RolePlan { compute_ctas: 33, comm_ctas: 0 }, 256, 8, 8));
        assert_eq!((p.send_by_gemm_ctas, p.grid, p.smem_bytes), (true, 33, 214_128));
        assert_eq!((p.group_m, p.burst_lists), (8, 12));
        // No burst without the GEMM, or at 2 ranks.
        assert_eq!(plan(Direction::Dispatch, &d, 33, None, &t, false, Activation::None).unwrap().burst_lists, 0);
        assert_eq!(
            plan(Direction::Dispatch, &dims(4096, 7168, 2048, 8, 256, 40960, 2), 33, None, &t, true, Activation::None)
                .unwrap()
                .burst_lists,
            0
        );
        // Combine: BN 256 over H, 28 column tiles in 4 bands of 7.
        let p = plan(Direction::Combine, &d, 33, None, &t, true, Activation::None).unwrap();
        assert_eq!((p.bn, p.tiles_n, p.band_w, p.send_by_gemm_ctas, p.burst_lists), (256, 28, 7, false, 0));
        // MK_COMM_SMS: dedicated CTAs beside the compute CTAs, no sends from the GEMM CTAs.
        let p = plan(Direction::Dispatch, &d, 33, Some(4), &t, true, Activation::None).unwrap();
        assert_eq!((p.roles, p.grid, p.send_by_gemm_ctas), (RolePlan { compute_ctas: 29, comm_ctas: 4 }, 33, false));
        assert!(plan(Direction::Dispatch, &d, 33, Some(33), &t, true, Activation::None).is_err());
        assert_eq!(p.layout, layout_offsets(4096, 8, 40960));
    }

    #[test]
    fn call_rules_are_named() {
        let err = |d: MoeDims| validate_dims(&d).unwrap_err().message;
        assert!(validate_dims(&dims(4096, 7168, 2048, 8, 256, 40960, 8)).is_ok());
        assert!(err(dims(4, 7168, 2000, 8, 256, 1024, 8)).contains("multiples of 128"));
        assert!(err(dims(4, 100, 256, 8, 256, 1024, 8)).contains("multiples of 128"));
        assert!(err(dims(4, 256, 256, 33, 256, 1024, 8)).contains("k = 33"));
        assert!(err(dims(4, 256, 256, 8, 2048, 1024, 8)).contains("E = 2048"));
        assert!(err(dims(4, 256, 256, 8, 12, 1024, 8)).contains("multiple of nranks"));
        assert!(err(dims(4, 256, 256, 8, 16, 1000, 8)).contains("recvCapacity = 1000"));
        assert!(err(dims(4, 7168, 256, 8, 16, 1 << 21, 8)).contains("lower recvCapacity"));
        // Products that wrap usize are refused, not wrapped into small values.
        assert!(err(dims(1 << 59, 256, 256, 32, 16, 1024, 8)).contains("sizes too large"), "T·k and T·H wrap to 0");
        assert!(err(dims(4, 1 << 57, 256, 8, 16, 1 << 21, 8)).contains("more than 2^64"), "the slab count wraps");
        assert!(
            err(dims(4, 256, (usize::MAX / 2 + 1) & !127, 8, 16, 1024, 8)).contains("sizes too large"),
            "E_local·F wraps"
        );
        let bf16 = mkDataType_t::mkBfloat16 as RawDataType;
        let d = dims(4, 256, 256, 2, 16, 1024, 2);
        let p = 0x1000;
        assert!(validate_dispatch(p, p, p, p, p, p, d, bf16).is_ok());
        assert!(validate_dispatch(0, p, p, p, p, p, d, bf16).unwrap_err().message.contains("x is NULL"));
        assert!(
            validate_dispatch(0, 0, p, p, p, p, dims(0, 256, 256, 2, 16, 1024, 2), bf16).is_ok(),
            "a rank without tokens still takes part"
        );
        assert!(validate_dispatch(p, p, p + 8, p, p, p, d, bf16)
            .unwrap_err()
            .message
            .contains("w1 = 0x1008 is not 16-byte aligned"));
        assert!(validate_dispatch(p, p, p, p, p, p, d, mkDataType_t::mkFloat32 as RawDataType)
            .unwrap_err()
            .message
            .contains("mkFloat16 or mkBfloat16"));
        assert!(validate_combine(p, p, p, p, 0, d, bf16).unwrap_err().message.contains("out is NULL"));
        assert!(validate_combine(p, p, p + 2, p, p, d, bf16).unwrap_err().message.contains("topkWeights"));
    }

    #[test]
    fn roles_leave_compute_the_most_and_follow_the_override() {
        // DeepSeek-V3-like dispatch on a full H200: 4096 tokens x 8 x 7168 x 2 bytes.
        let bytes = 4096.0 * 8.0 * 7168.0 * 2.0;
        let flops = 2.0 * 4096.0 * 8.0 * 2048.0 * 7168.0;
        let p = plan_roles(bytes, flops, 132, None).unwrap();
        assert!(p.comm_ctas >= 1 && p.comm_ctas <= 66 && p.compute_ctas + p.comm_ctas == 132, "{p:?}");
        // No GEMM work: communication gets at most half.
        assert_eq!(plan_roles(1e9, 0.0, 16, None).unwrap(), RolePlan { compute_ctas: 8, comm_ctas: 8 });
        assert_eq!(plan_roles(1.0, 1e15, 8, None).unwrap().comm_ctas, 1);
        assert_eq!(plan_roles(bytes, flops, 66, Some(5)).unwrap(), RolePlan { compute_ctas: 61, comm_ctas: 5 });
        assert!(plan_roles(bytes, flops, 8, Some(8)).unwrap_err().message.contains("MK_COMM_SMS"));
        assert!(plan_roles(bytes, flops, 1, None).is_err());
        // The combine pulls after its GEMM, on every CTA, unless MK_COMM_SMS says.
        assert_eq!(
            plan_roles_for(Direction::Combine, bytes, flops, 132, None).unwrap(),
            RolePlan { compute_ctas: 132, comm_ctas: 0 }
        );
        assert_eq!(
            plan_roles_for(Direction::Combine, bytes, flops, 1, None).unwrap(),
            RolePlan { compute_ctas: 1, comm_ctas: 0 }
        );
        assert_eq!(
            plan_roles_for(Direction::Combine, bytes, flops, 66, Some(5)).unwrap(),
            RolePlan { compute_ctas: 61, comm_ctas: 5 }
        );
        // The dispatch's last GEMM CTA computes the layout first; the GEMM CTAs send, unless
        // MK_COMM_SMS says (then the first communication CTA computes the layout).
        assert_eq!(
            plan_roles_for(Direction::Dispatch, bytes, flops, 132, None).unwrap(),
            RolePlan { compute_ctas: 132, comm_ctas: 0 }
        );
        assert_eq!(
            plan_roles_for(Direction::Dispatch, bytes, flops, 1, None).unwrap(),
            RolePlan { compute_ctas: 1, comm_ctas: 0 }
        );
        assert_eq!(
            plan_roles_for(Direction::Dispatch, bytes, flops, 132, Some(7)).unwrap(),
            RolePlan { compute_ctas: 125, comm_ctas: 7 }
        );
        assert!(plan_roles_for(Direction::Dispatch, bytes, flops, 0, None).is_err());
    }

    #[test]
    fn burst_is_forced_or_planned_by_rank_count() {
        assert!(burst_for(None, 4) && burst_for(None, 8) && !burst_for(None, 2) && !burst_for(None, 1));
        assert!(burst_for(Some(true), 2) && !burst_for(Some(false), 4));
    }

    #[test]
    fn burst_covers_the_first_wave_and_one_more_expert() {
        // 4 ranks, DeepSeek-V3-like: ~512 rows (4 blocks) per expert, 16 CTAs x 8 column tiles:
        // the first wave is 2 blocks of expert 0; experts 0 and 1 of every destination.
        assert_eq!(burst_lists(&dims(4096, 7168, 2048, 8, 256, 40960, 4), 16, 8), 8);
        // 2 ranks: ~256 rows (2 blocks), 32 CTAs: 4 blocks = experts 0-1, plus 2.
        assert_eq!(burst_lists(&dims(4096, 7168, 2048, 8, 256, 40960, 2), 32, 8), 6);
        // 1 rank, 132 CTAs: 17 blocks of 1 block each, plus 1.
        assert_eq!(burst_lists(&dims(4096, 7168, 2048, 8, 256, 40960, 1), 132, 8), 18);
        // Never more lists than there are.
        assert_eq!(burst_lists(&dims(40, 384, 256, 2, 8, 512, 2), 132, 1), 8);
    }

    #[test]
    fn layout_buffer_and_prep_memory() {
        let lo = layout_offsets(10, 3, 512);
        assert_eq!(
            (lo.dest, lo.row, lo.mb_expert, lo.mb_order, lo.mb_srcmask, lo.mb_run, lo.mb_seg),
            (4, 34, 64, 68, 72, 76, 80)
        );
        assert_eq!((lo.mb_rows, lo.send, lo.send_row0, lo.words), (84, 88, 118, 118 + MAX_EXPERTS + 1));
        assert_eq!(checked_layout_offsets(usize::MAX / 2, 3, 512), None);
        assert_eq!(checked_layout_offsets(usize::MAX / 8, 3, 512), None, "3·slots wraps though T·k does not");
        assert_eq!(checked_layout_offsets(usize::MAX, 1, 0), None, "the first table offset wraps");
        // The largest call fits the prep CTA's shared memory beside the narrowest engine.
        let d = dims(4096, 7168, 2048, 8, MAX_EXPERTS, MAX_CAPACITY_BLOCKS * ROW_BLOCK, 8);
        assert!(
            prep_smem_bytes(&d) <= engine::smem_bytes(256, Epilogue::Tma).min(engine::smem_bytes(128, Epilogue::Tma))
        );
    }

    #[test]
    fn prep_split_covers_the_tokens_and_fits_its_scratch() {
        // A CTA's worth per thread first: 4096 tokens over 384 threads is 11 CTAs.
        assert_eq!(prep_split(4096, 32, 1, 132, 384), PrepSplit { ctas: 11, tokens_per_cta: 373 });
        assert_eq!(prep_split(16384, 256, 8, 132, 384), PrepSplit { ctas: 43, tokens_per_cta: 382 });
        // Decode sizes: one CTA; no tokens: one CTA with nothing to count.
        assert_eq!(prep_split(256, 32, 2, 132, 384).ctas, 1);
        assert_eq!(prep_split(0, 32, 2, 132, 384).ctas, 1);
        // The grid and the scratch bound the CTAs: 1024 experts at 8 ranks leave room for 6.
        assert_eq!(prep_split(1 << 20, 32, 1, 132, 384).ctas, 132);
        assert_eq!(prep_split(1 << 20, MAX_EXPERTS, 8, 132, 384).ctas, 6);
        for tokens in [0, 1, 383, 384, 385, 4095, 4097, 65537, 1 << 20] {
            for experts in [1, 7, 32, 256, 1000, MAX_EXPERTS] {
                for nranks in [1, 2, 8] {
                    for grid in [1, 2, 16, 132] {
                        let s = prep_split(tokens, experts, nranks, grid, 384);
                        let at = format!("T {tokens} E {experts} n {nranks} grid {grid}: {s:?}");
                        assert!(s.ctas >= 1 && s.ctas <= grid && s.tokens_per_cta >= 1, "{at}");
                        assert!(s.ctas * s.tokens_per_cta >= tokens, "every token has a CTA: {at}");
                        assert!((s.ctas - 1) * s.tokens_per_cta < tokens.max(1), "no CTA without tokens: {at}");
                        assert!((nranks + s.ctas + 2) * experts * 4 <= COUNTS_BYTES, "the scratch fits: {at}");
                    }
                }
            }
        }
    }

    #[test]
    fn device_layout_pads_experts_and_finds_every_slot() {
        // 2 ranks, 4 experts (2 each), k = 2, skew: expert 0 takes 130 rows (two blocks).
        let s = shape(130, 2, 4, 2);
        let r0: Vec<i32> = (0..130).flat_map(|t| [0, if t % 3 == 0 { 3 } else { -1 }]).collect();
        let r1: Vec<i32> =
            (0..130).flat_map(|t| [if t % 2 == 0 { 0 } else { 2 }, if t == 5 { 2 } else { -1 }]).collect();
        let routing = vec![r0, r1];
        let l0 = device_layout(&s, &routing, 0).unwrap();
        assert_eq!(l0.recv_counts, vec![130 + 65, 0]);
        assert_eq!(l0.expert_base, vec![0, 256]);
        let l1 = device_layout(&s, &routing, 1).unwrap();
        assert_eq!(l1.recv_counts, vec![65, 44]);
        assert_eq!(l1.expert_base, vec![0, 128]);
        assert_eq!(l0.rows_needed, 256, "the most over ranks");
        assert_eq!(l1.rows_needed, 256);
        // Rank 1's token 0 (expert 0) lands after rank 0's 130 rows on rank 0.
        assert_eq!(l1.slots[0], Some((0, 130)));
        // Rank 1's token 5 lists expert 2 twice: one row, both choices point at it.
        assert_eq!(l1.slots[10], l1.slots[11]);
        assert_eq!(l0.slots[1], Some((1, 128)), "rank 0 token 0 -> expert 3 = rank 1's second expert");
        for (row, r) in &l0.rows {
            let e = r.local_expert;
            assert!(*row >= l0.expert_base[e] && *row < l0.expert_base[e] + l0.recv_counts[e]);
        }
    }

    /// Uniform-ish routing: token t of rank r picks k distinct experts (a small LCG).
    fn routing_for(tokens: usize, top_k: usize, experts: usize, nranks: usize, seed: u64) -> Vec<Vec<i32>> {
        let mut x = seed;
        (0..nranks)
            .map(|_| {
                (0..tokens)
                    .flat_map(|_| {
                        let mut picked: Vec<i32> = Vec::new();
                        while picked.len() < top_k {
                            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                            let e = ((x >> 33) % experts as u64) as i32;
                            if !picked.contains(&e) {
                                picked.push(e);
                            }
                        }
                        picked
                    })
                    .collect()
            })
            .collect()
    }

    fn check_tables(t: &BlockTables) {
        let nb = t.expert.len();
        let mut seen = vec![false; nb];
        for &b in &t.order {
            assert!(!seen[b], "order is a permutation");
            seen[b] = true;
        }
        assert!(seen.iter().all(|&v| v));
        for w in t.order.windows(2) {
            assert!((t.key[w[0]], w[0]) < (t.key[w[1]], w[1]), "by key, then index (expert-major inside a key)");
        }
        for (p, &b) in t.order.iter().enumerate() {
            let (rs, len) = t.run[b];
            assert!(rs <= p && p < rs + len);
            for q in rs..rs + len {
                assert_eq!(
                    (t.expert[t.order[q]], t.key[t.order[q]]),
                    (t.expert[b], t.key[b]),
                    "a run is one (key, expert)"
                );
            }
            assert!(
                rs == 0 || (t.expert[t.order[rs - 1]], t.key[t.order[rs - 1]]) != (t.expert[b], t.key[b]),
                "runs are maximal"
            );
            let (first, blocks) = t.seg[b];
            assert!(first <= b && b < first + blocks && t.expert[first] == t.expert[b]);
            assert!(first == 0 || t.expert[first - 1] != t.expert[b]);
            assert!(t.srcmask[b] != 0, "every block holds a row");
        }
        assert!(t.order.iter().enumerate().all(|(p, &b)| p == b), "expert-major: the layout's order");
        assert_eq!(t.run, t.seg, "runs are the experts' segments");
        for b in 0..nb {
            let (first, blocks) = t.seg[b];
            let last = b + 1 == first + blocks;
            assert!(
                t.rows[b] >= 1 && t.rows[b] <= ROW_BLOCK && (last || t.rows[b] == ROW_BLOCK),
                "block {b}: {} rows",
                t.rows[b]
            );
        }
    }

    /// Every tile of tiles_m x tiles_n exactly once; with runs, the groups cut each run into
    /// balanced pieces of at most group_m blocks, and a group's tiles are its blocks' tiles.
    fn check_raster(t: &BlockTables, tiles_n: usize, group_m: usize, use_order: bool, runs: Option<&[(usize, usize)]>) {
        let tiles_m = t.expert.len();
        let order = use_order.then_some(&t.order[..]);
        let at_order = |p: usize| order.map_or(p, |o| o[p]);
        let mut hit = vec![0u8; tiles_m * tiles_n];
        for i in 0..tiles_m * tiles_n {
            let (b, n) = moe_tile(order, runs, tiles_m, tiles_n, group_m, i);
            assert!(n < tiles_n);
            hit[b * tiles_n + n] += 1;
        }
        assert!(hit.iter().all(|&h| h == 1), "every tile once");
        let Some(runs) = runs else { return };
        let mut p = 0;
        while p < tiles_m {
            let run = runs[at_order(p)];
            assert_eq!(run.0, p, "runs tile the order positions");
            let mut sizes = Vec::new();
            let mut q = p;
            while q < p + run.1 {
                let (gs, gl) = run_group(run, group_m, q);
                assert_eq!(gs, q, "a group starts where the last one ended");
                assert!(gl >= 1 && gl <= group_m);
                for at in gs..gs + gl {
                    assert_eq!(run_group(run, group_m, at), (gs, gl));
                    assert_eq!(runs[at_order(at)], run, "a group never straddles two runs");
                }
                let blocks: std::collections::BTreeSet<usize> = (gs * tiles_n..(gs + gl) * tiles_n)
                    .map(|i| moe_tile(order, Some(runs), tiles_m, tiles_n, group_m, i).0)
                    .collect();
                assert_eq!(blocks, (gs..gs + gl).map(at_order).collect());
                sizes.push(gl);
                q += gl;
            }
            assert_eq!(sizes.len(), run.1.div_ceil(group_m));
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "balanced: {sizes:?}");
            p += run.1;
        }
    }

    #[test]
    fn block_order_mirrors_the_prep_and_the_raster_covers_every_tile() {
        for (nranks, tokens, top_k, experts) in
            [(1, 300, 2, 8), (2, 400, 4, 16), (4, 512, 8, 32), (8, 256, 8, 64), (3, 200, 3, 12)]
        {
            let s = shape(tokens, top_k, experts, nranks);
            let routing = routing_for(tokens, top_k, experts, nranks, 7 + nranks as u64);
            for rank in 0..nranks {
                let t = block_tables(&s, &routing, rank).unwrap();
                let dl = device_layout(&s, &routing, rank).unwrap();
                assert_eq!(
                    t.expert.len() * ROW_BLOCK,
                    dl.expert_base.last().unwrap() + dl.recv_counts.last().unwrap().next_multiple_of(ROW_BLOCK)
                );
                check_tables(&t);
                for (tiles_n, g) in [(1, 1), (8, 5), (3, 2), (28, 6), (4, 100)] {
                    let g = g.min(t.expert.len()).max(1);
                    check_raster(&t, tiles_n, g, true, None);
                    check_raster(&t, tiles_n, g, true, Some(&t.run));
                    check_raster(&t, tiles_n, g, false, Some(&t.seg));
                }
            }
        }
    }

    #[test]
    fn the_block_order_is_the_receive_layout_and_counts_add_up() {
        let s = shape(512, 8, 32, 4);
        let routing = routing_for(512, 8, 32, 4, 3);
        // The receive layout's order (expert-major), one key.
        let e = block_tables(&s, &routing, 2).unwrap();
        assert!(e.key.iter().all(|&k| k == 0) && e.order.windows(2).all(|w| w[0] < w[1]));
        // Block rows add up to the experts' counts.
        let dl = device_layout(&s, &routing, 2).unwrap();
        for (le, &c) in dl.recv_counts.iter().enumerate() {
            assert_eq!((0..e.expert.len()).filter(|&b| e.expert[b] == le).map(|b| e.rows[b]).sum::<usize>(), c);
        }
    }

    #[test]
    fn send_lists_cover_every_row_once_expert_by_expert() {
        for (nranks, tokens, top_k, experts) in [(1, 300, 2, 8), (2, 400, 4, 16), (4, 512, 8, 32), (3, 200, 3, 12)] {
            let s = shape(tokens, top_k, experts, nranks);
            let mut routing = routing_for(tokens, top_k, experts, nranks, 5 + nranks as u64);
            // Holes and a token naming one expert twice (one row, sent once).
            routing[0][0] = -1;
            routing[0][top_k.min(2) * 3 - 1] = routing[0][top_k.min(2) * 3 - 2];
            let el = experts / nranks;
            for rank in 0..nranks {
                let dl = device_layout(&s, &routing, rank).unwrap();
                let (row0, slots) = send_tables(&s, &routing[rank], rank);
                assert_eq!(row0.len(), experts + 1);
                assert_eq!(row0[experts], slots.len());
                let mut rows_sent = std::collections::HashSet::new();
                for q in 0..experts {
                    let (d, le) = ((rank + q % nranks) % nranks, q / nranks);
                    let list = &slots[row0[q]..row0[q + 1]];
                    for (i, &slot) in list.iter().enumerate() {
                        assert_eq!(routing[rank][slot], (d * el + le) as i32);
                        let (owner, row) = dl.slots[slot].unwrap();
                        assert_eq!(owner, d);
                        // The kernel writes entry row0[q] + (row - the list's first row).
                        assert_eq!(row, dl.slots[list[0]].unwrap().1 + i, "list {q}: consecutive rows at the owner");
                        assert!(rows_sent.insert((d, row)), "each row once");
                    }
                }
                // Every distinct (token, expert) of this rank is in some list.
                let distinct: usize = routing[rank]
                    .chunks(top_k)
                    .map(|c| {
                        let mut v: Vec<_> = c.iter().filter(|&&e| e >= 0).collect();
                        v.sort();
                        v.dedup();
                        v.len()
                    })
                    .sum();
                assert_eq!(slots.len(), distinct);
            }
        }
    }

    #[test]
    fn expert_groups_share_b_tiles_in_a_wave() {
        // DeepSeek-V3-like routing at 4 ranks (scaled: T 1024, E 64, so ~4.5 blocks per
        // local expert as at T 4096, E 256): one wave of 15 dispatch tiles (tiles_n 8,
        // group 5) touches far fewer (expert, n-block) B tiles in expert order.
        let s = shape(1024, 8, 64, 4);
        let routing = routing_for(1024, 8, 64, 4, 11);
        let d = dims(1024, 7168, 2048, 8, 64, 1 << 14, 4);
        let g = group_m(&d, 256, 15);
        assert_eq!(g, 5);
        let wave_b_tiles = |t: &BlockTables, runs: Option<&[(usize, usize)]>| -> f64 {
            let tiles = t.expert.len() * 8;
            let mut sum = 0usize;
            for w0 in (0..tiles).step_by(15) {
                let mut bt: Vec<(usize, usize)> = (w0..tiles.min(w0 + 15))
                    .map(|i| {
                        let (b, n) = moe_tile(Some(&t.order), runs, t.expert.len(), 8, g, i);
                        (t.expert[b], n)
                    })
                    .collect();
                bt.sort();
                bt.dedup();
                sum += bt.len();
            }
            sum as f64 / tiles.div_ceil(15) as f64
        };
        let expert = block_tables(&s, &routing, 1).unwrap();
        // The comparison: blocks by the send step of the latest source they hold (rank 1 of
        // 4), fixed raster groups.
        let mut arrival = expert.clone();
        arrival.key = expert
            .srcmask
            .iter()
            .map(|&m| (0..4).filter(|&src| m >> src & 1 != 0).map(|src| (1 + 4 - src) % 4).max().unwrap())
            .collect();
        arrival.order.sort_by_key(|&b| (arrival.key[b], b));
        let (a, e) = (wave_b_tiles(&arrival, None), wave_b_tiles(&expert, Some(&expert.run)));
        assert!(e * 2.0 < a, "B tiles per wave: arrival {a:.1}, expert {e:.1}");
    }

    #[test]
    fn bands_divide_the_columns_and_run_in_order() {
        assert_eq!(band_width(28, 4), 7);
        assert_eq!(band_width(28, 3), 14, "the most bands up to 3 that divide 28: 2");
        assert_eq!(band_width(28, 1), 28);
        assert_eq!(band_width(1, 4), 1);
        assert_eq!(band_width(7, 4), 7, "7 is prime: one band");
        assert_eq!(band_width(8, 100), 1);
        let s = shape(400, 4, 16, 2);
        let routing = routing_for(400, 4, 16, 2, 9);
        let t = block_tables(&s, &routing, 1).unwrap();
        let tiles_m = t.expert.len();
        for (tiles_n, bw, g) in [(28, 7, 5), (8, 2, 3), (6, 3, 1), (4, 4, 2)] {
            let mut hit = vec![0u8; tiles_m * tiles_n];
            let mut last_band = 0;
            for i in 0..tiles_m * tiles_n {
                let (b, n) = moe_tile_banded(None, Some(&t.seg), tiles_m, tiles_n, bw, g, i);
                hit[b * tiles_n + n] += 1;
                assert!(n / bw >= last_band, "bands in order");
                last_band = n / bw;
            }
            assert!(hit.iter().all(|&h| h == 1), "every tile once");
            // Within a band: as the unbanded raster over the band's columns.
            for i in 0..tiles_m * bw {
                let (b0, n0) = moe_tile(None, Some(&t.seg), tiles_m, bw, g, i);
                for band in 0..tiles_n / bw {
                    assert_eq!(
                        moe_tile_banded(None, Some(&t.seg), tiles_m, tiles_n, bw, g, band * tiles_m * bw + i),
                        (b0, band * bw + n0)
                    );
                }
            }
            // The pull's items: every (token, tile) once, band by band.
            let tokens = 37;
            let mut seen = vec![false; tokens * tiles_n];
            for it in 0..tokens * tiles_n {
                let (tok, n) = pull_item(tokens, tiles_n, bw, it);
                assert!(!seen[tok * tiles_n + n]);
                seen[tok * tiles_n + n] = true;
                assert_eq!(n / bw, it / (tokens * bw));
            }
        }
    }

    #[test]
    fn group_cap_balances_a_and_b_rows() {
        // 4 ranks on one H200 (16 CTAs each), T 4096, k 8, E 256: dispatch 15 GEMM CTAs, BN 256.
        let d = dims(4096, 7168, 2048, 8, 256, 40960, 4);
        assert_eq!(group_m(&d, 256, 15), 5);
        assert_eq!(group_m(&d, 256, 16), 6);
        assert_eq!(group_m(&d, 256, 7), 4);
        assert_eq!(group_m(&d, 256, 131), 16);
        // Never more than the blocks there can be.
        assert_eq!(group_m(&dims(4, 256, 256, 1, 8, 128, 1), 256, 132), 1);
    }
}
