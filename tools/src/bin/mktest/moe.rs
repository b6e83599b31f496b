//! mkMoeDispatchGemm and mkMoeGemmCombine on the GPU with MK_TEST_NRANKS ranks.
//!
//! Per case and rank: fresh random tokens, weights and a skewed routing (one hot expert,
//! experts that get no token, −1 holes, an expert listed twice by one token; ranks may hold
//! different numbers of tokens, zero included), generated from seeds so every rank can
//! rebuild every rank's inputs. The dispatch's recvCounts must equal ops::moe's layout and
//! every received row of Y must match a float64 reference x_row·W1_eᵀ; the combine (fed a
//! fresh random Y', independent of Y) must match Σ_j w·round(Y'_row·W2_eᵀ) in float64.
//! Outputs are NaN-poisoned first (NaN never passes). Then graph capture with fresh routing
//! on each replay, the capacity overflow and drop mode (moe_capacity), and (several ranks)
//! a rank that never calls.

use crate::collectives::{ffi, say, Stream};
use crate::fused_common::{self, FusedCase};
use crate::outcome::{self, Outcome};
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::fused::{
    mkMoeDispatchGemm, mkMoeDispatchGemmWithOptions, mkMoeGemmCombine, mkMoeLayoutBytes, mkMoeOptions_t,
};
use mkernel::ffi::mkComm_t;
use mkernel::ops::moe::{
    block_tables, device_layout, drop_counts, layout_offsets, send_tables, Activation, DeviceLayout, MoeShape,
    MK_MOE_DROP, MK_MOE_NO_DROP, ROW_BLOCK,
};
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::{check_close, check_exact, tolerance, Rule, TestBuffer};
use std::cell::RefCell;

pub fn run() -> Result<Outcome> {
    fused_common::run_suite(
        "moe",
        |comm, control, rank, n| {
            correctness(comm, control, rank, n)
                .and_then(|_| repeats_are_bitwise(comm, rank, n))
                .and_then(|_| graph_replay(comm, rank, n))
                .and_then(|_| crate::moe_capacity::overflow_then_retry(comm, rank, n))
                .and_then(|_| crate::moe_capacity::drop_mode(comm, rank, n))
                .and_then(|_| crate::moe_gated::gated(comm, rank, n))
        },
        absent_rank,
    )
}

/// Small deterministic generator (routing and weights are made on the host).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Sizes {
    pub(crate) tokens: usize,
    /// Odd ranks hold this many tokens instead (0: a rank with nothing to send).
    pub(crate) tokens_odd: usize,
    pub(crate) hidden: usize,
    pub(crate) ffn: usize,
    pub(crate) top_k: usize,
    pub(crate) experts: usize,
    pub(crate) dtype: mkDataType_t,
    /// At most this many distinct experts get tokens (besides the hot one).
    pub(crate) spread: usize,
}

pub(crate) fn tokens_of(s: &Sizes, r: usize) -> usize {
    if r % 2 == 1 {
        s.tokens_odd
    } else {
        s.tokens
    }
}

/// Every rank's routing and weights for `seed`: choice 0 often the hot expert, −1 holes,
/// repeats, and a band of experts (those ≡ 1 mod 3) that never get a token.
pub(crate) fn routing(s: &Sizes, n: usize, seed: u64) -> (Vec<Vec<i32>>, Vec<Vec<f32>>) {
    let hot = (seed as usize * 7) % s.experts;
    let allowed: Vec<usize> = (0..s.experts).filter(|e| e % 3 != 1).take(s.spread.max(1)).collect();
    let mut ids = Vec::new();
    let mut ws = Vec::new();
    for r in 0..n {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (seed * 1000 + r as u64 + 1));
        let t = tokens_of(s, r);
        let mut v = Vec::with_capacity(t * s.top_k);
        let mut w = Vec::with_capacity(t * s.top_k);
        for _ in 0..t {
            for j in 0..s.top_k {
                let roll = rng.below(100);
                let e = if roll < 35 {
                    hot as i32
                } else if roll < 43 {
                    -1
                } else if roll < 48 && j > 0 {
                    v[v.len() - 1]
                } else {
                    allowed[rng.below(allowed.len())] as i32
                };
                v.push(e);
                w.push(rng.unit() + 0.05);
            }
        }
        ids.push(v);
        ws.push(w);
    }
    (ids, ws)
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One configuration's device buffers (the largest T of any rank) on one rank.
pub(crate) struct Case {
    s: Sizes,
    n: usize,
    rank: usize,
    capacity: usize,
    /// Drop mode's rows per (source rank, expert) (mkMoeDispatchGemmWithOptions); None: no-drop
    /// mode through mkMoeDispatchGemm.
    expert_capacity: Option<usize>,
    /// The dispatch's GEMM: plain, or a gated w1 [E_local, 2·F, H] (SwiGLU, GeGLU) through
    /// mkMoeDispatchGemmWithOptions.
    activation: Activation,
    /// Every rank's tokens, W2 and Y' (one allocation per rank; this rank passes its own).
    x_shards: Vec<TestBuffer>,
    w1: TestBuffer,
    w2_shards: Vec<TestBuffer>,
    idx: TestBuffer,
    weights: TestBuffer,
    y: TestBuffer,
    yact_shards: Vec<TestBuffer>,
    counts: TestBuffer,
    /// [E] int32: this rank's dropped rows per expert (drop mode).
    drops: TestBuffer,
    layout: TestBuffer,
    out: TestBuffer,
    /// The routing of the last `FusedCase::prepare`, which `verify` checks against.
    inputs: RefCell<Option<Inputs>>,
}

pub(crate) struct Inputs {
    ids: Vec<Vec<i32>>,
    weights: Vec<Vec<f32>>,
    layout: DeviceLayout,
    seed: u64,
}

impl Case {
    pub(crate) fn new(s: Sizes, n: usize, rank: usize, capacity: usize) -> Result<Case> {
        Case::with_policy(s, n, rank, capacity, None)
    }

    /// A case in drop mode (`expert_capacity` Some) or no-drop mode.
    pub(crate) fn with_policy(
        s: Sizes,
        n: usize,
        rank: usize,
        capacity: usize,
        expert_capacity: Option<usize>,
    ) -> Result<Case> {
        Case::with_options(s, n, rank, capacity, expert_capacity, Activation::None)
    }

    /// A case with a capacity policy and the dispatch's activation (gated: w1 holds 2·F rows
    /// per expert).
    pub(crate) fn with_options(
        s: Sizes,
        n: usize,
        rank: usize,
        capacity: usize,
        expert_capacity: Option<usize>,
        activation: Activation,
    ) -> Result<Case> {
        let t_max = s.tokens.max(s.tokens_odd).max(1);
        let el = s.experts / n;
        let mut words = 0usize;
        // SAFETY: valid out-pointer.
        let r = unsafe { mkMoeLayoutBytes(t_max, s.top_k, capacity, &mut words) };
        if r != mkResult_t::mkSuccess {
            return Err(MkError::new(r, "mkMoeLayoutBytes"));
        }
        Ok(Case {
            s,
            n,
            rank,
            capacity,
            expert_capacity,
            activation,
            x_shards: (0..n).map(|_| TestBuffer::new(t_max * s.hidden, s.dtype)).collect::<Result<_>>()?,
            w1: TestBuffer::new(el * activation.w1_rows(s.ffn) * s.hidden, s.dtype)?,
            w2_shards: (0..n).map(|_| TestBuffer::new(el * s.hidden * s.ffn, s.dtype)).collect::<Result<_>>()?,
            idx: TestBuffer::new(t_max * s.top_k, mkDataType_t::mkInt32)?,
            weights: TestBuffer::new(t_max * s.top_k, mkDataType_t::mkFloat32)?,
            y: TestBuffer::new(capacity * s.ffn, s.dtype)?,
            yact_shards: (0..n).map(|_| TestBuffer::new(capacity * s.ffn, s.dtype)).collect::<Result<_>>()?,
            counts: TestBuffer::new(el + 1, mkDataType_t::mkInt32)?,
            drops: TestBuffer::new(s.experts, mkDataType_t::mkInt32)?,
            layout: TestBuffer::new(words / 4, mkDataType_t::mkInt32)?,
            out: TestBuffer::new(t_max * s.hidden, s.dtype)?,
            inputs: RefCell::new(None),
        })
    }

    pub(crate) fn label(&self) -> String {
        let s = &self.s;
        format!(
            "{} T={}/{} H={} F={} k={} E={} cap={}{}{}",
            s.dtype.name(),
            s.tokens,
            s.tokens_odd,
            s.hidden,
            s.ffn,
            s.top_k,
            s.experts,
            self.capacity,
            self.expert_capacity.map_or(String::new(), |c| format!(" drop>{c}")),
            if self.activation.gated() { format!(" {:?}-gated", self.activation) } else { String::new() }
        )
    }

    pub(crate) fn shape_of(&self, rank: usize) -> MoeShape {
        let s = &self.s;
        MoeShape {
            expert_capacity: self.expert_capacity,
            ..MoeShape::new(tokens_of(s, rank), s.top_k, s.experts, self.n)
        }
    }

    pub(crate) fn recv_counts(&self) -> Result<Vec<i32>> {
        Ok(self.counts.download()?.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect())
    }

    pub(crate) fn y(&self) -> &TestBuffer {
        &self.y
    }

    pub(crate) fn out(&self) -> &TestBuffer {
        &self.out
    }

    fn t_max(&self) -> usize {
        self.s.tokens.max(self.s.tokens_odd).max(1)
    }

    /// Fresh inputs for `seed` (every rank's x, W2, Y' regenerated from seeds); outputs and
    /// the layout buffer poisoned (the dispatch must fill the layout every call).
    pub(crate) fn fresh_inputs(&self, seed: u64) -> Result<Inputs> {
        let s = &self.s;
        let null = std::ptr::null_mut();
        fused_common::fill_shards(&self.x_shards, seed * 100, 1.0)?;
        fused_common::fill_shards(&self.w2_shards, seed * 100 + 30, 0.5)?;
        fused_common::fill_shards(&self.yact_shards, seed * 100 + 60, 1.0)?;
        self.w1.randomize(seed * 100 + 90 + self.rank as u64, 0.5, null)?;
        let (ids, weights) = routing(s, self.n, seed);
        let t = tokens_of(s, self.rank);
        let mut own = ids[self.rank].clone();
        own.resize(self.t_max() * s.top_k, -1);
        self.idx.upload(&i32_bytes(&own))?;
        let mut w = weights[self.rank].clone();
        w.resize(self.t_max() * s.top_k, 0.0);
        self.weights.upload(&f32_bytes(&w))?;
        debug_assert!(ids[self.rank].len() == t * s.top_k);
        self.y.poison(null)?;
        self.out.poison(null)?;
        self.counts.poison(null)?;
        self.drops.poison(null)?;
        self.layout.poison(null)?;
        fused_common::sync_default_stream()?;
        debug_assert_eq!(self.shape_of(self.rank).tokens, t);
        let layout = device_layout(&self.shape_of(self.rank), &ids, self.rank)?;
        Ok(Inputs { ids, weights, layout, seed })
    }

    pub(crate) fn dispatch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        let s = &self.s;
        let x = self.x_shards[self.rank].ptr();
        if self.expert_capacity.is_some() || self.activation.gated() {
            let options = mkMoeOptions_t {
                capacityPolicy: if self.expert_capacity.is_some() { MK_MOE_DROP } else { MK_MOE_NO_DROP },
                expertCapacity: self.expert_capacity.unwrap_or(0) as i64,
                activation: self.activation.code(),
                ..mkMoeOptions_t::initializer()
            };
            return self.dispatch_with_options(comm, stream, &options);
        }
        // SAFETY: device buffers of the sizes the op expects.
        unsafe {
            mkMoeDispatchGemm(
                x as *const _,
                self.idx.ptr() as *const i32,
                self.w1.ptr() as *const _,
                self.y.ptr() as *mut _,
                self.counts.ptr() as *mut i32,
                self.layout.ptr() as *mut _,
                tokens_of(s, self.rank),
                s.hidden,
                s.ffn,
                s.top_k,
                s.experts,
                self.capacity,
                s.dtype as i32,
                comm,
                stream,
            )
        }
    }

    /// mkMoeDispatchGemmWithOptions on this case's buffers with `options` (also options that
    /// do not fit them: the argument tests).
    pub(crate) fn dispatch_with_options(
        &self,
        comm: mkComm_t,
        stream: sys::CUstream,
        options: &mkMoeOptions_t,
    ) -> mkResult_t {
        let s = &self.s;
        let x = self.x_shards[self.rank].ptr();
        // SAFETY: device buffers of the sizes the op expects (w1 as this case allocated it);
        // options a live struct.
        unsafe {
            mkMoeDispatchGemmWithOptions(
                x as *const _,
                self.idx.ptr() as *const i32,
                self.w1.ptr() as *const _,
                self.y.ptr() as *mut _,
                self.counts.ptr() as *mut i32,
                self.drops.ptr() as *mut i32,
                self.layout.ptr() as *mut _,
                tokens_of(s, self.rank),
                s.hidden,
                s.ffn,
                s.top_k,
                s.experts,
                self.capacity,
                s.dtype as i32,
                options,
                comm,
                stream,
            )
        }
    }

    pub(crate) fn combine(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        let s = &self.s;
        let yact = self.yact_shards[self.rank].ptr();
        // SAFETY: device buffers of the sizes the op expects.
        unsafe {
            mkMoeGemmCombine(
                yact as *const _,
                self.w2_shards[self.rank].ptr() as *const _,
                self.weights.ptr() as *const f32,
                self.layout.ptr() as *const _,
                self.out.ptr() as *mut _,
                tokens_of(s, self.rank),
                s.hidden,
                s.ffn,
                s.top_k,
                s.experts,
                self.capacity,
                s.dtype as i32,
                comm,
                stream,
            )
        }
    }

    /// recvCounts and every received row of Y against float64.
    pub(crate) fn verify_dispatch(&self, inp: &Inputs) -> Result<(bool, String)> {
        let s = &self.s;
        let (h, f) = (s.hidden, s.ffn);
        let el = s.experts / self.n;
        let counts: Vec<i32> =
            self.counts.download()?.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
        let mut want: Vec<i32> = inp.layout.recv_counts.iter().map(|&c| c as i32).collect();
        want.push(inp.layout.rows_needed as i32);
        if counts != want {
            return Ok((false, format!("recvCounts {counts:?}, expected {want:?}")));
        }
        if self.expert_capacity.is_some() {
            let dropped: Vec<i32> =
                self.drops.download()?.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
            let want: Vec<i32> =
                drop_counts(&self.shape_of(self.rank), &inp.ids[self.rank]).iter().map(|&v| v as i32).collect();
            if dropped != want {
                return Ok((false, format!("dropCounts {dropped:?}, expected {want:?}")));
            }
        }
        if let Some(msg) = self.verify_block_tables(inp)? {
            return Ok((false, msg));
        }
        let x: Vec<Vec<f64>> = self.x_shards.iter().map(|b| b.download_f64()).collect::<Result<_>>()?;
        let w1 = self.w1.download_f64()?;
        let y = self.y.download_f64()?;
        let rule = Rule::reduction(s.dtype, h);
        let mut out = Vec::with_capacity(inp.layout.rows.len() * f);
        let mut reference = Vec::with_capacity(inp.layout.rows.len() * f);
        let mut bounds = Vec::with_capacity(inp.layout.rows.len() * f);
        let dot = |xr: &[f64], wr: &[f64]| {
            xr.iter().zip(wr).fold((0.0, 0.0), |(s, g), (a, b)| (s + a * b, g + (a * b).abs()))
        };
        // w1 rows per expert: F, or the gate's F then the up projection's F.
        let rows_per_expert = self.activation.w1_rows(f);
        for (row, r) in &inp.layout.rows {
            let xr = &x[r.source][r.token * h..][..h];
            let w1_expert = &w1[r.local_expert * rows_per_expert * h..][..rows_per_expert * h];
            for c in 0..f {
                let (value, bound) = if self.activation.gated() {
                    let (gate, up) = (dot(xr, &w1_expert[c * h..][..h]), dot(xr, &w1_expert[(f + c) * h..][..h]));
                    crate::moe_gated::reference(self.activation, gate, up, &rule)
                } else {
                    let (d, mag) = dot(xr, &w1_expert[c * h..][..h]);
                    (d, rule.bound(d, mag))
                };
                reference.push(value);
                bounds.push(bound);
                out.push(y[row * f + c]);
            }
        }
        let _ = el;
        let verdict = check_close(&out, &reference, &bounds, tolerance(s.dtype));
        let guards = self.guards()?;
        let ok = verdict.passed() && guards.is_none();
        Ok((
            ok,
            format!(
                "{} rows: {verdict}{}",
                inp.layout.rows.len(),
                guards.map_or(String::new(), |w| format!("; GUARD {w}"))
            ),
        ))
    }

    /// The prep's m-block tables in the layout buffer against ops::moe::block_tables (the
    /// host mirror). None: equal.
    fn verify_block_tables(&self, inp: &Inputs) -> Result<Option<String>> {
        let s = &self.s;
        let t = inp.ids[self.rank].len() / s.top_k;
        let shape = self.shape_of(self.rank);
        debug_assert_eq!(shape.tokens, t);
        // The dispatch's prep writes the tables.
        let want = block_tables(&shape, &inp.ids, self.rank)?;
        let words: Vec<i32> =
            self.layout.download()?.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
        let lo = layout_offsets(t, s.top_k, self.capacity); // as the launch: this call's tokens
        let nb = want.expert.len();
        let pack = |v: &[(usize, usize)]| v.iter().map(|&(a, l)| (a | l << 15) as i32).collect::<Vec<_>>();
        let as_i32 = |v: &[usize]| v.iter().map(|&x| x as i32).collect::<Vec<_>>();
        let (send_row0, send) = send_tables(&shape, &inp.ids[self.rank], self.rank);
        let checks: [(&str, usize, Vec<i32>); 8] = [
            ("m-block experts", lo.mb_expert, as_i32(&want.expert)),
            ("m-block sources", lo.mb_srcmask, want.srcmask.iter().map(|&m| m as i32).collect()),
            ("m-block order", lo.mb_order, as_i32(&want.order)),
            ("m-block runs", lo.mb_run, pack(&want.run)),
            ("m-block segments", lo.mb_seg, pack(&want.seg)),
            ("m-block rows", lo.mb_rows, as_i32(&want.rows)),
            ("send list starts", lo.send_row0, as_i32(&send_row0)),
            ("send list", lo.send, as_i32(&send)),
        ];
        if words[0] as usize != nb {
            return Ok(Some(format!("layout: {} m-blocks in use, expected {nb}", words[0])));
        }
        for (name, off, v) in checks {
            if words[off..off + v.len()] != v[..] {
                return Ok(Some(format!(
                    "layout: {name} differ from ops::moe::{}",
                    if name.starts_with("send") { "send_tables" } else { "block_tables" }
                )));
            }
        }
        Ok(None)
    }

    /// out[t] against Σ_j w·round(Y'_owner[row]·W2_eᵀ) in float64.
    pub(crate) fn verify_combine(&self, inp: &Inputs) -> Result<(bool, String)> {
        let s = &self.s;
        let (h, f, k) = (s.hidden, s.ffn, s.top_k);
        let el = s.experts / self.n;
        let yact: Vec<Vec<f64>> = self.yact_shards.iter().map(|b| b.download_f64()).collect::<Result<_>>()?;
        let w2: Vec<Vec<f64>> = self.w2_shards.iter().map(|b| b.download_f64()).collect::<Result<_>>()?;
        let out_all = self.out.download_f64()?;
        let t = tokens_of(s, self.rank);
        let choices: Vec<Vec<Choice>> = (0..t)
            .map(|tok| {
                (0..k)
                    .filter_map(|j| {
                        let (d, row) = inp.layout.slots[tok * k + j]?;
                        let le = inp.ids[self.rank][tok * k + j] as usize - d * el;
                        Some(Choice {
                            weight: inp.weights[self.rank][tok * k + j] as f64,
                            y_row: &yact[d][row * f..][..f],
                            w2: &w2[d][le * h * f..][..h * f],
                        })
                    })
                    .collect()
            })
            .collect();
        let (reference, bounds) = combine_reference(&choices, h, f, k, s.dtype);
        let out = &out_all[..t * h];
        // Tokens with no expert are exactly 0 (a bound of 0 demands it too; this says which).
        let empty: Vec<usize> =
            (0..t).filter(|&tok| inp.layout.slots[tok * k..(tok + 1) * k].iter().all(Option::is_none)).collect();
        let zeros = empty
            .iter()
            .fold(check_exact(&[], &[]), |v, &tok| v.and(check_exact(&out[tok * h..(tok + 1) * h], &vec![0.0; h])));
        let verdict = check_close(out, &reference, &bounds, tolerance(s.dtype));
        let guards = self.guards()?;
        let ok = verdict.passed() && zeros.passed() && guards.is_none();
        Ok((
            ok,
            format!(
                "{t} tokens: {verdict}{}{}",
                if zeros.passed() { String::new() } else { format!("; empty tokens not 0: {zeros}") },
                guards.map_or(String::new(), |w| format!("; GUARD {w}"))
            ),
        ))
    }

    /// None when every buffer's guard bands are intact (outputs, layout and inputs).
    fn guards(&self) -> Result<Option<String>> {
        let mut buffers: Vec<(&str, &TestBuffer)> = vec![
            ("y", &self.y),
            ("recvCounts", &self.counts),
            ("dropCounts", &self.drops),
            ("layout", &self.layout),
            ("out", &self.out),
            ("w1", &self.w1),
            ("topkIdx", &self.idx),
            ("topkWeights", &self.weights),
        ];
        buffers.extend(self.x_shards.iter().map(|b| ("x shard", b)));
        buffers.extend(self.w2_shards.iter().map(|b| ("w2 shard", b)));
        buffers.extend(self.yact_shards.iter().map(|b| ("yAct shard", b)));
        fused_common::guards_intact(&buffers)
    }
}

/// One round of the pair: the dispatch, then the combine on the same routing (it reads the
/// layout the dispatch wrote), each checked against float64.
impl FusedCase for Case {
    fn label(&self) -> String {
        Case::label(self)
    }

    fn prepare(&self, seed: u64) -> Result<()> {
        *self.inputs.borrow_mut() = Some(self.fresh_inputs(seed)?);
        Ok(())
    }

    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        fused_common::launch_back_to_back(self, comm, stream)
    }

    fn ops(&self) -> usize {
        2
    }

    fn launch_op(&self, i: usize, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        if i == 0 {
            self.dispatch(comm, stream)
        } else {
            self.combine(comm, stream)
        }
    }

    fn verify(&self) -> Result<(bool, String)> {
        let inputs = self.inputs.borrow();
        let inp = inputs.as_ref().ok_or_else(|| MkError::internal("MoE case verified before prepare"))?;
        let (dispatch_ok, dispatch) = self.verify_dispatch(inp)?;
        let (combine_ok, combine) = self.verify_combine(inp)?;
        Ok((dispatch_ok && combine_ok, format!("seed {}: dispatch {dispatch}; combine {combine}", inp.seed)))
    }
}

/// One routed choice of a token: its weight, the owner's row of Y' [ffn] and the expert's
/// W2 [hidden, ffn].
struct Choice<'a> {
    weight: f64,
    y_row: &'a [f64],
    w2: &'a [f64],
}

/// out[t] = Σ_j w_j·Z_j in float64, Z_j = Y'_row·W2ᵀ, with each element's bound: each Z_j a
/// dot product of `ffn` terms rounded to the element type (its own bound, weighted by w_j),
/// then the weighted terms summed in fp32 (`top_k` additions and a product each) and
/// rounded once. A token with no choice has the bound 0: exactly 0.
fn combine_reference(
    tokens: &[Vec<Choice>],
    h: usize,
    f: usize,
    top_k: usize,
    dtype: mkDataType_t,
) -> (Vec<f64>, Vec<f64>) {
    let (z_rule, sum_rule) = (Rule::reduction(dtype, f), Rule::reduction(dtype, top_k + 1));
    let mut reference = vec![0f64; tokens.len() * h];
    let mut bounds = vec![0f64; tokens.len() * h];
    for (tok, choices) in tokens.iter().enumerate() {
        for c in 0..h {
            let (mut total, mut slack, mut terms_abs) = (0.0, 0.0, 0.0);
            for ch in choices {
                let (z, mag) = ch
                    .y_row
                    .iter()
                    .zip(&ch.w2[c * f..(c + 1) * f])
                    .fold((0.0, 0.0), |(s, g), (a, b)| (s + a * b, g + (a * b).abs()));
                total += ch.weight * z;
                slack += ch.weight * z_rule.bound(z, mag);
                terms_abs += (ch.weight * z).abs();
            }
            reference[tok * h + c] = total;
            bounds[tok * h + c] = if choices.is_empty() { 0.0 } else { slack + sum_rule.bound(total, terms_abs) };
        }
    }
    (reference, bounds)
}

fn sizes_list() -> Vec<Sizes> {
    use mkDataType_t::{mkBfloat16 as BF, mkFloat16 as FP};
    let sz = |tokens, tokens_odd, hidden, ffn, top_k, experts, dtype, spread| Sizes {
        tokens,
        tokens_odd,
        hidden,
        ffn,
        top_k,
        experts,
        dtype,
        spread,
    };
    vec![
        sz(37, 37, 384, 256, 2, 8, BF, 8),
        sz(50, 23, 256, 384, 8, 64, FP, 40),
        sz(100, 0, 128, 128, 8, 256, BF, 60),
        sz(3, 5, 256, 256, 1, 8, FP, 8),
        // Decode sizes: 1 and 16 tokens (odd ranks 16 and 0), the smallest hidden and ffn.
        sz(1, 16, 128, 128, 4, 8, FP, 8),
        sz(16, 0, 128, 256, 2, 16, BF, 16),
        // Enough tokens that several CTAs share the prep (ops::moe::prep_split: 4 and 3).
        sz(1200, 777, 256, 256, 6, 64, BF, 48),
        // Top-k past 8 and past 16 (the prep's slot loops are unrolled to 8, 16 or 32).
        sz(500, 130, 128, 256, 12, 32, FP, 24),
        sz(90, 45, 128, 128, 20, 32, BF, 24),
        // DeepSeek-V3-sized expert matrices (E kept small so every rank can rebuild them).
        sz(40, 40, 7168, 2048, 2, 8, BF, 8),
    ]
}

/// The smallest recvCapacity this seed's routing needs, plus `slack` blocks.
pub(crate) fn capacity_for(s: &Sizes, n: usize, seed: u64, slack: usize) -> Result<usize> {
    capacity_with_drop(s, n, seed, slack, None)
}

/// [`capacity_for`] in drop mode (`expert_capacity` Some) or no-drop mode.
pub(crate) fn capacity_with_drop(
    s: &Sizes,
    n: usize,
    seed: u64,
    slack: usize,
    expert_capacity: Option<usize>,
) -> Result<usize> {
    let (ids, _) = routing(s, n, seed);
    let shape = MoeShape { expert_capacity, ..MoeShape::new(tokens_of(s, 0), s.top_k, s.experts, n) };
    Ok(device_layout(&shape, &ids, 0)?.rows_needed.max(ROW_BLOCK) + slack * ROW_BLOCK)
}

fn correctness(comm: mkComm_t, _control: &Comm, rank: usize, n: usize) -> Result<()> {
    let (mut checks, mut failures) = (0, 0);
    for (i, s) in sizes_list().into_iter().enumerate() {
        // Sanitizer-sized (fused_common::sanitizer_sized): the DeepSeek-sized expert matrices
        // add no code path the smaller hidden sizes do not take.
        if s.experts % n != 0 || (fused_common::sanitizer_sized() && s.hidden >= 4096) {
            continue;
        }
        let (first_seed, rounds) = (1 + 10 * i as u64, if s.hidden >= 4096 { 1 } else { 2 });
        // Capacity: exactly what the first seed needs (tight), and enough for the others.
        let mut cap = 0;
        for seed in first_seed..first_seed + rounds {
            cap = cap.max(capacity_for(&s, n, seed, 0)?);
        }
        let case = Case::new(s, n, rank, cap)?;
        let (c, f) = fused_common::check_rounds(comm, rank, "MoE", &case, first_seed, rounds, &|_| {})?;
        checks += c;
        failures += f;
    }
    fused_common::count_checks(rank, "MoE", checks, failures)
}

/// The GEMMs take their tiles from a ticket counter, so which CTA computes a tile changes
/// from launch to launch; a tile's math does not. The same inputs (outputs poisoned again
/// before each launch) must give the same bits in every routed row of Y and in out, with
/// about two tiles per CTA (200-300 tiles per GEMM) and skewed experts. The values themselves
/// are checked by `correctness`; here they must only be finite and not all zero.
fn repeats_are_bitwise(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let stream = Stream::for_rank()?;
    let s = Sizes {
        tokens: 2000,
        tokens_odd: 1500,
        hidden: 1024,
        ffn: 1024,
        top_k: 4,
        experts: 16,
        dtype: mkDataType_t::mkBfloat16,
        spread: 10,
    };
    let seed = 91;
    let case = Case::new(s, n, rank, capacity_for(&s, n, seed, 0)?)?;
    let mut first: Option<Vec<u64>> = None;
    let mut ok = true;
    for launch in 0..3 {
        case.prepare(seed)?;
        fused_common::peers_ready()?;
        ffi(&format!("MoE repeat {}", case.label()), fused_common::launch_call(&case, comm, stream.0)?, comm)?;
        fused_common::sync_no_error(comm, &stream, &format!("MoE repeat, launch {launch}"))?;
        let inputs = case.inputs.borrow();
        let inp = inputs.as_ref().ok_or_else(|| MkError::internal("MoE case launched before prepare"))?;
        let (y, out) = (case.y.download_f64()?, case.out.download_f64()?);
        let mut values: Vec<f64> =
            inp.layout.rows.iter().flat_map(|(row, _)| y[row * s.ffn..][..s.ffn].to_vec()).collect();
        values.extend_from_slice(&out[..tokens_of(&s, rank) * s.hidden]);
        let sane = values.iter().all(|v| v.is_finite()) && values.iter().any(|&v| v != 0.0);
        let bits: Vec<u64> = values.iter().map(|v| v.to_bits()).collect();
        let same = first.as_ref().is_none_or(|f| *f == bits);
        if !(sane && same) {
            ok = false;
            say(
                rank,
                format!(
                    "MoE repeat {} launch {launch}: finite and nonzero {sane}, same bits {same} -> WRONG",
                    case.label()
                ),
            );
        }
        first.get_or_insert(bits);
    }
    outcome::count(1);
    if rank == 0 {
        say(rank, format!("MoE repeat {}: 3 launches, same bits -> {}", case.label(), if ok { "ok" } else { "WRONG" }));
    }
    if !ok {
        return Err(MkError::internal("MoE results differ between launches of the same inputs"));
    }
    Ok(())
}

/// A dispatch + combine of a few dozen tokens per rank over 16 experts (a skewed routing),
/// for the suites that run it among other ops or many times.
pub(crate) fn small_sizes() -> Sizes {
    Sizes {
        tokens: 29,
        tokens_odd: 17,
        hidden: 256,
        ffn: 256,
        top_k: 4,
        experts: 16,
        dtype: mkDataType_t::mkBfloat16,
        spread: 12,
    }
}

/// Dispatch and combine captured in one graph, replayed on fresh routings (the counts
/// change, the graph does not), with direct calls between replays.
fn graph_replay(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let s = small_sizes();
    // Room for the routing of every seed fused_common::graph_replay uses.
    let mut cap = 0;
    for seed in fused_common::graph_replay_seeds() {
        cap = cap.max(capacity_for(&s, n, seed, 0)?);
    }
    fused_common::graph_replay(comm, rank, "MoE dispatch+combine", &Case::new(s, n, rank, cap)?)
}

fn absent_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let s = Sizes {
        tokens: 64,
        tokens_odd: 64,
        hidden: 256,
        ffn: 256,
        top_k: 2,
        experts: 8,
        dtype: mkDataType_t::mkBfloat16,
        spread: 8,
    };
    let case = Case::new(s, n, rank, capacity_for(&s, n, 5, 0)?)?;
    // The absent rank's progress word was never written: a survivor's timeout on its counts
    // says so (kernel_abi MOE_PROGRESS).
    let progress = format!("rank {} had begun no MoE dispatch", n - 1);
    fused_common::absent_rank_with_progress(
        env,
        control,
        2,
        "mkMoeDispatchGemm (a rank absent)",
        Some(&progress),
        |comm, stream| {
            case.fresh_inputs(5)?;
            Ok(case.dispatch(comm, stream))
        },
    )
}

#[cfg(test)]
mod tests {
    //! The combine's bound against its documented rounding simulated on the CPU: each Z
    //! accumulated in f32 and rounded to the element type, the weighted terms summed in f32
    //! in choice order, rounded once.
    use super::*;
    use mkernel_tools::testing::{round_to, xorshift_unit};

    /// Values in [-scale, 3·scale), rounded to `dtype`.
    fn values(seed: u64, n: usize, dtype: mkDataType_t, scale: f64) -> Vec<f64> {
        xorshift_unit(seed, n).map(|u| round_to(dtype, scale * (4.0 * u - 1.0))).collect()
    }

    #[test]
    fn combined_tokens_pass_and_a_dropped_choice_fails() {
        let (h, f, top_k, tokens, experts) = (128, 256, 4, 12, 3);
        for dtype in [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16] {
            let y = values(1, tokens * top_k * f, dtype, 1.0);
            let w2 = values(2, experts * h * f, dtype, 0.5);
            let weights = values(3, tokens * top_k, mkDataType_t::mkFloat32, 0.5);
            // Token 5 has no expert; the others top_k choices of experts (i + j) mod E.
            let choices: Vec<Vec<Choice>> = (0..tokens)
                .map(|t| {
                    if t == 5 {
                        return Vec::new();
                    }
                    (0..top_k)
                        .map(|j| Choice {
                            weight: weights[t * top_k + j].abs() + 0.05,
                            y_row: &y[(t * top_k + j) * f..][..f],
                            w2: &w2[((t + j) % experts) * h * f..][..h * f],
                        })
                        .collect()
                })
                .collect();
            let (reference, bounds) = combine_reference(&choices, h, f, top_k, dtype);
            let simulate = |drop: Option<(usize, usize)>| -> Vec<f64> {
                let mut out = vec![0f64; tokens * h];
                for (t, ch) in choices.iter().enumerate() {
                    for c in 0..h {
                        let mut acc = 0f32;
                        for (j, x) in ch.iter().enumerate() {
                            if drop == Some((t, j)) {
                                continue;
                            }
                            let z = x
                                .y_row
                                .iter()
                                .zip(&x.w2[c * f..(c + 1) * f])
                                .fold(0f32, |s, (a, b)| s + (a * b) as f32);
                            acc += x.weight as f32 * round_to(dtype, z as f64) as f32;
                        }
                        out[t * h + c] = round_to(dtype, acc as f64);
                    }
                }
                out
            };
            let v = check_close(&simulate(None), &reference, &bounds, tolerance(dtype));
            assert!(v.passed(), "{}: {v}", dtype.name());
            let v = check_close(&simulate(Some((7, 2))), &reference, &bounds, tolerance(dtype));
            assert!(!v.passed() && v.wrong > h / 2 && v.worst.unwrap().index / h == 7, "{}: {v}", dtype.name());
        }
    }
}
