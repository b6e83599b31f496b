//! mkAllGatherScaledGemm on the GPU with MK_TEST_NRANKS ranks (processes sharing the GPU
//! under MPS, one per GPU, or rank threads with MK_TEST_THREADS=1); one rank runs the
//! scaled GEMM alone.
//!
//! Per rank: both output types × the three scale modes (block where K is a multiple of
//! 128) × shapes (decode sizes of 1-16 rows per rank, the smallest K and N, rows per rank
//! that straddle tiles, a partial last 128-row block of B's scales), each twice with fresh
//! inputs (the device-side epochs advance): once with exact-sum inputs, once quantized as a
//! user quantizes (gemm_fp8.rs says what each proves). Every rank generates every rank's
//! shard from the same seeds, so it knows the whole gathered A; C is checked element by
//! element against float64 of the dequantized gathered inputs with gemm_fp8.rs's bound
//! (the kernel's arithmetic is the scaled GEMM's: the same mainloop), on every row of a
//! small C, else on three rows of every shard; C starts NaN-poisoned and every buffer's
//! guard bands must be intact. Per tensor, each rank's shard has its own scale (the op's
//! contract), so a wrong shard-to-scale pairing fails. Then the C entry point's refusals
//! (nothing written), capture in a CUDA graph with replays on fresh inputs, and, with
//! several ranks, a rank that never calls: the others stop within the timeout.
//! Bytes on the wire: each case prints what the plan pushes beside mkAllGatherGemm's bf16
//! (ops::dense::ag_scaled_gemm::pushed_bytes, unit-tested there).

use crate::collectives::say;
use crate::fused_common::{self, FusedCase};
use crate::gemm_fp8::{self, Inputs, Operand, Side, BLOCK, MODES, OUTPUTS};
use crate::outcome::Outcome;
use crate::ranks::RankEnv;
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::fused::mkAllGatherScaledGemm;
use mkernel::ffi::mkComm_t;
use mkernel::ops::dense::ag_scaled_gemm::{pushed_bytes, pushed_bytes_16bit};
use mkernel::types::{mkDataType_t, mkScaleMode_t};
use mkernel_tools::testing::{check_close, to_f64, TestBuffer};
use std::cell::{Cell, RefCell};
use std::ffi::c_void;

pub fn run() -> Result<Outcome> {
    fused_common::run_suite(
        "ag_gemm_fp8",
        |comm, _control, rank, n| {
            correctness(comm, rank, n).and_then(|_| refusals(comm, rank, n)).and_then(|_| graph_replay(comm, rank, n))
        },
        absent_rank,
    )
}

/// The host's copy of one round's inputs: every rank's shard of A and B.
struct HostInputs {
    shards: Vec<Operand>,
    b: Operand,
}

/// One problem: this rank's shard of A and its scales, B and its scales, C, each between
/// guard bands; the host inputs of the last `prepare`.
struct Case {
    out: mkDataType_t,
    mode: mkScaleMode_t,
    rows_per_rank: usize,
    n: usize,
    k: usize,
    nranks: usize,
    rank: usize,
    a: TestBuffer,
    scale_a: TestBuffer,
    b: TestBuffer,
    scale_b: TestBuffer,
    c: TestBuffer,
    inputs: Cell<Inputs>,
    /// The seed of the last `prepare` (it also picks the rows checked of a large C).
    seed: Cell<u64>,
    host: RefCell<Option<HostInputs>>,
}

/// Scales of an operand of `rows` rows under `mode` (A's layouts; B's block scales are one
/// per 128 rows).
fn scale_count(mode: mkScaleMode_t, side: Side, rows: usize, k: usize) -> usize {
    match (mode, side) {
        (mkScaleMode_t::mkScaleTensor, _) => 1,
        (mkScaleMode_t::mkScaleRowwise, _) => rows,
        (mkScaleMode_t::mkScaleBlock, Side::A) => k / BLOCK * rows,
        (mkScaleMode_t::mkScaleBlock, Side::B) => k / BLOCK * rows.div_ceil(BLOCK),
    }
}

impl Case {
    #[allow(clippy::too_many_arguments)]
    fn new(
        out: mkDataType_t,
        mode: mkScaleMode_t,
        rows_per_rank: usize,
        n: usize,
        k: usize,
        nranks: usize,
        rank: usize,
    ) -> Result<Case> {
        let m = rows_per_rank * nranks;
        let f32s = |count| TestBuffer::new(count, mkDataType_t::mkFloat32);
        Ok(Case {
            out,
            mode,
            rows_per_rank,
            n,
            k,
            nranks,
            rank,
            a: TestBuffer::new(rows_per_rank * k, mkDataType_t::mkFloat8e4m3)?,
            scale_a: f32s(scale_count(mode, Side::A, rows_per_rank, k))?,
            b: TestBuffer::new(n * k, mkDataType_t::mkFloat8e4m3)?,
            scale_b: f32s(scale_count(mode, Side::B, n, k))?,
            c: TestBuffer::new(m * n, out)?,
            inputs: Cell::new(Inputs::Quantized),
            seed: Cell::new(0),
            host: RefCell::new(None),
        })
    }

    fn m(&self) -> usize {
        self.rows_per_rank * self.nranks
    }

    /// The gathered A as one operand for gemm_fp8's reference: the shards' rows in rank
    /// order and their scales in the layout of the gathered rows (per tensor: each shard's
    /// scale on each of its rows, as rowwise scales).
    fn gathered(&self, shards: &[Operand]) -> Operand {
        let (m, rows, k) = (self.m(), self.rows_per_rank, self.k);
        let bytes: Vec<u8> = shards.iter().flat_map(|s| s.bytes.iter().copied()).collect();
        let values: Vec<f64> = shards.iter().flat_map(|s| s.values.iter().copied()).collect();
        let (mode, scales) = match self.mode {
            mkScaleMode_t::mkScaleTensor => {
                (mkScaleMode_t::mkScaleRowwise, shards.iter().flat_map(|s| vec![s.scales[0]; rows]).collect())
            }
            mkScaleMode_t::mkScaleRowwise => {
                (mkScaleMode_t::mkScaleRowwise, shards.iter().flat_map(|s| s.scales.iter().copied()).collect())
            }
            mkScaleMode_t::mkScaleBlock => {
                let mut g = vec![0f32; k / BLOCK * m];
                for (r, s) in shards.iter().enumerate() {
                    for kb in 0..k / BLOCK {
                        g[kb * m + r * rows..kb * m + (r + 1) * rows]
                            .copy_from_slice(&s.scales[kb * rows..(kb + 1) * rows]);
                    }
                }
                (mkScaleMode_t::mkScaleBlock, g)
            }
        };
        Operand { dtype: mkDataType_t::mkFloat8e4m3, bytes, values, scales, mode, side: Side::A, rows: m }
    }

    /// Rows of C checked: every row of a small C, else the first, the last and a middle
    /// row of every shard (each shard comes from another rank).
    fn rows_to_check(&self, seed: u64) -> Vec<usize> {
        let (m, rows) = (self.m(), self.rows_per_rank);
        if m * self.n <= 1 << 20 {
            return (0..m).collect();
        }
        let mut out: Vec<usize> =
            (0..self.nranks).flat_map(|r| [r * rows, r * rows + (seed as usize % rows), (r + 1) * rows - 1]).collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    fn call(&self, comm: mkComm_t, stream: sys::CUstream, bad: &Bad) -> mkResult_t {
        let k = bad.k.unwrap_or(self.k);
        let ab = bad.ab.unwrap_or(mkDataType_t::mkFloat8e4m3);
        let mode = bad.mode.unwrap_or(self.mode as i32);
        // SAFETY: device buffers of the sizes the op expects, or arguments it refuses
        // before any access.
        unsafe {
            mkAllGatherScaledGemm(
                (bad.a.unwrap_or(self.a.ptr()) + bad.a_offset) as *const c_void,
                bad.scale_a.unwrap_or(self.scale_a.ptr()) as *const f32,
                self.b.ptr() as *const c_void,
                self.scale_b.ptr() as *const f32,
                self.c.ptr() as *mut c_void,
                bad.m.unwrap_or(self.m()),
                self.n,
                k,
                ab as i32,
                self.out as i32,
                mode,
                comm,
                stream,
            )
        }
    }
}

/// One broken argument of a refused call (None: the case's own).
#[derive(Default)]
struct Bad {
    /// A in place of the case's (host memory, say).
    a: Option<u64>,
    a_offset: u64,
    scale_a: Option<u64>,
    m: Option<usize>,
    k: Option<usize>,
    ab: Option<mkDataType_t>,
    mode: Option<i32>,
}

impl FusedCase for Case {
    fn label(&self) -> String {
        format!(
            "e4m3->{} {:?} {:?} M={} ({}x{}) N={} K={}",
            self.out.name(),
            self.mode,
            self.inputs.get(),
            self.m(),
            self.nranks,
            self.rows_per_rank,
            self.n,
            self.k
        )
    }

    /// Fresh inputs: shard s of A from seed (seed, s) on every rank (so every rank knows
    /// the whole A), B from its own; this rank's shard and B uploaded, C poisoned with NaN.
    fn prepare(&self, seed: u64) -> Result<()> {
        let (rows, n, k, mode, inputs) = (self.rows_per_rank, self.n, self.k, self.mode, self.inputs.get());
        let shards: Vec<Operand> = (0..self.nranks)
            .map(|s| gemm_fp8::operand(Side::A, rows, k, mode, inputs, seed * 1000 + s as u64))
            .collect();
        let b = gemm_fp8::operand(Side::B, n, k, mode, inputs, seed * 1000 + 999);
        let own = &shards[self.rank];
        self.a.upload(&own.bytes)?;
        self.scale_a.upload(&own.scales.iter().flat_map(|s| s.to_le_bytes()).collect::<Vec<u8>>())?;
        self.b.upload(&b.bytes)?;
        self.scale_b.upload(&b.scales.iter().flat_map(|s| s.to_le_bytes()).collect::<Vec<u8>>())?;
        self.c.poison(std::ptr::null_mut())?;
        *self.host.borrow_mut() = Some(HostInputs { shards, b });
        self.seed.set(seed);
        fused_common::sync_default_stream()
    }

    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        self.call(comm, stream, &Bad::default())
    }

    /// (passed, detail): C element-wise against the float64 reference of the dequantized
    /// gathered inputs, no element left non-finite (poison), every guard band intact.
    fn verify(&self) -> Result<(bool, String)> {
        let host = self.host.borrow();
        let host = host.as_ref().ok_or_else(|| MkError::internal("verify before prepare"))?;
        let a = self.gathered(&host.shards);
        let rows = self.rows_to_check(self.seed.get());
        let (want, bound) = gemm_fp8::reference(&a, &host.b, &rows, self.n, self.k, self.out, self.inputs.get());
        let all = to_f64(&self.c.download()?, self.out);
        let nonfinite = all.iter().filter(|v| !v.is_finite()).count();
        let got: Vec<f64> = rows.iter().flat_map(|&r| all[r * self.n..(r + 1) * self.n].iter().copied()).collect();
        let verdict = check_close(&got, &want, &bound, gemm_fp8::l2_limit(self.out, self.inputs.get()));
        let buffers = [
            ("C", &self.c),
            ("A shard", &self.a),
            ("scaleA", &self.scale_a),
            ("B", &self.b),
            ("scaleB", &self.scale_b),
        ];
        let guards = fused_common::guards_intact(&buffers)?;
        let ok = verdict.passed() && nonfinite == 0 && guards.is_none();
        Ok((
            ok,
            format!(
                "C ({} rows): {verdict}, {nonfinite} non-finite{}",
                rows.len(),
                guards.map_or(String::new(), |w| format!("; GUARD {w}"))
            ),
        ))
    }
}

/// (rows per rank, N, K): decode sizes, the smallest K (16) and N (8), shards that straddle
/// tiles, a partial last 128-row block of B (block scales), K not a multiple of 128.
fn shapes() -> Vec<(usize, usize, usize)> {
    vec![(1, 264, 128), (4, 8, 16), (16, 136, 256), (97, 264, 384), (128, 520, 128), (200, 1000, 1024), (333, 776, 272)]
}

fn outputs() -> &'static [mkDataType_t] {
    if fused_common::sanitizer_sized() {
        &OUTPUTS[..1]
    } else {
        &OUTPUTS
    }
}

fn correctness(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let (mut checks, mut failures) = (0, 0);
    for &out in outputs() {
        for mode in MODES {
            for (rows, cols, k) in shapes() {
                if mode == mkScaleMode_t::mkScaleBlock && k % BLOCK != 0 {
                    continue;
                }
                let case = Case::new(out, mode, rows, cols, k, n, rank)?;
                if rank == 0 && out == OUTPUTS[0] && mode == MODES[0] {
                    let (fp8, bf16) = (pushed_bytes(rows, k, mode, n), pushed_bytes_16bit(rows, k, n));
                    say(rank, format!("{rows}x{k} per rank: pushes {fp8} bytes per call, bf16 {bf16}"));
                }
                // Round 0 exact sums, round 1 quantized.
                let (c, f) = fused_common::check_rounds(comm, rank, "mkAllGatherScaledGemm", &case, 23, 2, &|round| {
                    case.inputs.set(if round == 0 { Inputs::ExactSums } else { Inputs::Quantized })
                })?;
                checks += c;
                failures += f;
            }
        }
    }
    fused_common::count_checks(rank, "mkAllGatherScaledGemm", checks, failures)
}

/// Every rule the entry point checks, each broken once: mkInvalidArgument, and C (poisoned
/// before) still all poison after: nothing was launched. No rank launches, so the ranks
/// need not agree on anything here.
fn refusals(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let case = Case::new(mkDataType_t::mkBfloat16, mkScaleMode_t::mkScaleRowwise, 64, 264, 272, n, rank)?;
    case.prepare(7)?;
    let s = std::ptr::null_mut();
    // 16-byte aligned host memory: refused as host memory, not for its alignment.
    let host = vec![0u128; (case.rows_per_rank * case.k).div_ceil(16)];
    let mut bad_m = vec![];
    if n > 1 {
        bad_m.push(("M not divisible by nranks", Bad { m: Some(case.m() + 1), ..Default::default() }));
    }
    let cases: Vec<(&str, Bad)> = [
        ("scaleA NULL", Bad { scale_a: Some(0), ..Default::default() }),
        ("scaleA misaligned", Bad { scale_a: Some(case.scale_a.ptr() + 2), ..Default::default() }),
        ("A misaligned", Bad { a_offset: 8, ..Default::default() }),
        ("A in host memory", Bad { a: Some(host.as_ptr() as u64), ..Default::default() }),
        ("K = 264 (not a multiple of 16)", Bad { k: Some(264), ..Default::default() }),
        ("block scales with K = 272", Bad { mode: Some(mkScaleMode_t::mkScaleBlock as i32), ..Default::default() }),
        ("scale mode 3", Bad { mode: Some(3), ..Default::default() }),
        ("e5m2 operands", Bad { ab: Some(mkDataType_t::mkFloat8e5m2), ..Default::default() }),
        ("bf16 operands", Bad { ab: Some(mkDataType_t::mkBfloat16), ..Default::default() }),
    ]
    .into_iter()
    .chain(bad_m)
    .collect();
    let (mut checks, mut failures) = (0, 0);
    for (what, bad) in &cases {
        let r = case.call(comm, s, bad);
        let ok = r == mkResult_t::mkInvalidArgument;
        checks += 1;
        failures += usize::from(!ok);
        if !ok || rank == 0 {
            say(rank, format!("mkAllGatherScaledGemm {what}: {r:?} -> {}", if ok { "ok" } else { "WRONG" }));
        }
    }
    fused_common::sync_default_stream()?;
    let untouched = case.c.download()?.iter().all(|&b| b == 0xff);
    checks += 1;
    failures += usize::from(!untouched);
    say(rank, format!("refusals wrote nothing: {}", if untouched { "ok" } else { "WRONG" }));
    fused_common::count_checks(rank, "mkAllGatherScaledGemm refusals", checks, failures)
}

fn graph_replay(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let case = Case::new(mkDataType_t::mkBfloat16, mkScaleMode_t::mkScaleBlock, 160, 392, 256, n, rank)?;
    fused_common::graph_replay(comm, rank, "mkAllGatherScaledGemm", &case)
}

fn absent_rank(env: &RankEnv, control: &Comm) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let case = Case::new(mkDataType_t::mkBfloat16, mkScaleMode_t::mkScaleTensor, 256, 1024, 512, n, rank)?;
    fused_common::absent_rank(env, control, 2, "mkAllGatherScaledGemm (a rank absent)", |comm, stream| {
        case.prepare(5)?;
        Ok(case.launch(comm, stream))
    })
}
