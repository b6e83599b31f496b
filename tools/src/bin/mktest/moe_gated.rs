//! The MoE dispatch with a gated weight (mkMoeDispatchGemmWithOptions, activation SiLU =
//! SwiGLU and GELU = GeGLU) on the GPU with MK_TEST_NRANKS ranks: w1 [E_local, 2·F, H]
//! (per expert F gate rows, then F up rows), and every received row of y [rows, F] against
//! the float64 act(x·w_gateᵀ) · (x·w_upᵀ) element-wise (NaN-poisoned outputs; the combine
//! of the same round checked as in `moe`), with skewed routing, at several F (1 to 3
//! output tiles per expert) and both element types; SwiGLU in drop mode and in a CUDA
//! graph; and the argument rules: a plain-sized w1 passed as gated, an activation code
//! out of range.

use crate::collectives::{last_error, say, Stream};
use crate::fused_common::{self, FusedCase};
use crate::moe::{capacity_for, capacity_with_drop, Case, Sizes};
use crate::outcome;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::fused::mkMoeOptions_t;
use mkernel::ffi::mkComm_t;
use mkernel::ops::moe::{Activation, MK_MOE_ACT_SILU};
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::Rule;

extern "C" {
    /// The C library's erf (glibc's libm, which std links on Linux): float64 GELU's Φ.
    fn erf(x: f64) -> f64;
}

/// act(g) in float64.
fn activate(act: Activation, g: f64) -> f64 {
    match act {
        Activation::None => g,
        Activation::Silu => g / (1.0 + (-g).exp()),
        // SAFETY: erf is a pure function of its argument.
        Activation::Gelu => 0.5 * g * (1.0 + unsafe { erf(g / std::f64::consts::SQRT_2) }),
    }
}

/// The largest |act'(g)| of SiLU (1.0998 near g = 2.4) and of GELU (1.1289 near g = 2.4).
const ACT_SLOPE: f64 = 1.13;

/// The float64 y element act(gate) · up and its bound, from the two dot products (value,
/// Σ|terms|) and the GEMM's rule for H terms: gate and up each carry the fp32 accumulation
/// error γ·Σ|terms| (not rounded to the element type: they stay in registers), which act
/// passes on at most ACT_SLOPE times; act and the product are evaluated in fp32 (a few
/// units of fp32 roundoff of |act(g)| + |g|, as GELU's 1 + erf cancels for negative g);
/// then one rounding to the element type (rtol·|y|).
pub fn reference(act: Activation, (gate, gate_mag): (f64, f64), (up, up_mag): (f64, f64), rule: &Rule) -> (f64, f64) {
    let y = activate(act, gate) * up;
    let (eg, eu) = (rule.gamma * gate_mag, rule.gamma * up_mag);
    let a = activate(act, gate).abs();
    let fp32_eval = 16.0 * f64::powi(2.0, -24) * (a + gate.abs() + ACT_SLOPE * eg) * (up.abs() + eu);
    let bound = 1.01 * (rule.floor + rule.rtol * y.abs() + ACT_SLOPE * eg * (up.abs() + eu) + a * eu + fp32_eval);
    (y, bound)
}

/// Shapes of the gated suite; E divisible by 8 ranks. F 384: three output tiles per expert
/// (n-blocks past the first and an odd tile count); F 128: one.
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
    vec![sz(64, 40, 256, 384, 2, 8, BF, 8), sz(100, 0, 128, 128, 4, 16, FP, 12), sz(300, 150, 512, 256, 6, 32, BF, 24)]
}

/// Every shape with SiLU and GELU (one round each), SwiGLU in drop mode and in a CUDA
/// graph, then the argument rules.
pub fn gated(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    let (mut checks, mut failures) = (0, 0);
    for act in [Activation::Silu, Activation::Gelu] {
        for (i, s) in sizes_list().into_iter().enumerate() {
            if s.experts % n != 0 {
                continue;
            }
            let seed = 500 + 10 * i as u64 + act.code() as u64;
            let case = Case::with_options(s, n, rank, capacity_for(&s, n, seed, 0)?, None, act)?;
            let (c, f) = fused_common::check_rounds(comm, rank, "MoE gated", &case, seed, 1, &|_| {})?;
            checks += c;
            failures += f;
        }
    }
    // SwiGLU with drop mode: a cap of one row in four of the hot expert's.
    let s = sizes_list()[0];
    let cap = (s.tokens * s.top_k).div_ceil(s.experts);
    let seed = 560;
    let recv = capacity_with_drop(&s, n, seed, 0, Some(cap))?;
    let dropping = Case::with_options(s, n, rank, recv, Some(cap), Activation::Silu)?;
    let (c, f) = fused_common::check_rounds(comm, rank, "MoE gated drop mode", &dropping, seed, 1, &|_| {})?;
    checks += c;
    failures += f;
    fused_common::count_checks(rank, "MoE gated", checks, failures)?;
    // The graph: fresh routing on each replay (graph_replay_seeds), so the capacity covers them.
    let mut graph_cap = 0;
    for seed in fused_common::graph_replay_seeds() {
        graph_cap = graph_cap.max(capacity_for(&s, n, seed, 0)?);
    }
    let graphed = Case::with_options(s, n, rank, graph_cap, None, Activation::Silu)?;
    fused_common::graph_replay(comm, rank, "MoE SwiGLU dispatch+combine", &graphed)?;
    argument_rules(comm, rank, n)
}

/// Refused before launch, naming the rule: a plain [E_local, F, H] w1 with a gated
/// activation (its allocation ends before the 2·F rows), an activation code out of range.
fn argument_rules(comm: mkComm_t, rank: usize, n: usize) -> Result<()> {
    // A plain w1 of at least 2 MiB per rank (E_local ≥ 1 of 1024 x 1024 bf16), so that
    // whatever granularity the driver reports allocations in, the gated 2·F rows pass its end.
    let s = Sizes { hidden: 1024, ffn: 1024, ..sizes_list()[0] };
    if s.experts % n != 0 {
        return Ok(());
    }
    let stream = Stream::for_rank()?;
    let seed = 570;
    let plain = Case::with_options(s, n, rank, capacity_for(&s, n, seed, 0)?, None, Activation::None)?;
    plain.prepare(seed)?;
    let init = mkMoeOptions_t::initializer();
    let cases: [(&str, mkMoeOptions_t, &str); 2] = [
        ("a plain-sized w1 with SwiGLU", mkMoeOptions_t { activation: MK_MOE_ACT_SILU, ..init }, "2·ffn"),
        ("activation 7", mkMoeOptions_t { activation: 7, ..init }, "options->activation = 7"),
    ];
    let mut wrong = 0;
    for (what, options, needle) in cases {
        let r = plain.dispatch_with_options(comm, stream.0, &options);
        let msg = last_error(comm);
        let ok = r == mkResult_t::mkInvalidArgument && msg.contains(needle);
        say(rank, format!("MoE gated, {what}: {r:?}, \"{msg}\" -> {}", if ok { "ok" } else { "WRONG" }));
        wrong += usize::from(!ok);
    }
    outcome::count(cases.len());
    fused_common::sync_no_error(comm, &stream, "MoE gated argument rules")?;
    if wrong > 0 {
        return Err(MkError::internal(format!("MoE gated: {wrong} argument rules not refused as specified")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float64_activations_match_their_definitions() {
        // silu(0) = 0, silu(g) → g for large g; gelu(0) = 0, gelu(1) = Φ(1) = 0.8413447460685429.
        assert_eq!(activate(Activation::Silu, 0.0), 0.0);
        assert!((activate(Activation::Silu, 40.0) - 40.0).abs() < 1e-12);
        assert!((activate(Activation::Silu, 1.0) - 1.0 / (1.0 + (-1f64).exp())).abs() < 1e-15);
        assert!((activate(Activation::Gelu, 1.0) - 0.8413447460685429).abs() < 1e-15);
        assert!((activate(Activation::Gelu, -1.0) + 0.15865525393145707).abs() < 1e-15);
        // The slope bound holds on a fine grid.
        for act in [Activation::Silu, Activation::Gelu] {
            for i in -4000..4000 {
                let g = i as f64 / 400.0;
                let slope = (activate(act, g + 1e-6) - activate(act, g - 1e-6)) / 2e-6;
                assert!(slope.abs() <= ACT_SLOPE, "{act:?} slope {slope} at {g}");
            }
        }
    }

    #[test]
    fn the_bound_rejects_a_swapped_gate_and_up() {
        let rule = Rule::reduction(mkDataType_t::mkBfloat16, 256);
        let (gate, up) = ((1.7, 20.0), (-0.6, 18.0));
        let (y, bound) = reference(Activation::Silu, gate, up, &rule);
        let (swapped, _) = reference(Activation::Silu, up, gate, &rule);
        assert!((y - swapped).abs() > bound, "{y} {swapped} {bound}");
        // bf16's rounding of y is inside it.
        assert!(bound >= rule.rtol * y.abs());
    }
}
