//! An element type enters as data. fp8 e4m3 (NCCL's value 10) is described in the type table
//! and has kernels only for mkScaledGemm and the one-node collectives: the planners size its
//! buffers from the description,
//! and choosing its kernel in any other family is a clear error ("no kernel for this dtype"),
//! not a panic or another type's kernel — without a line of those ops changed for it.

use mkernel::error::mkResult_t;
use mkernel::ops::attention::{ring_attention, ring_attention_backward};
use mkernel::ops::collectives::{self, hier, CollectiveKind};
use mkernel::ops::dense::{ag_gemm, gemm_reduce};
use mkernel::ops::gemm::engine::{self, PlanOverrides};
use mkernel::ops::moe::{self, Direction};
use mkernel::tuning::{Tuning, COLLECTIVE_LL_MAX_BYTES};
use mkernel::types::{mkDataType_t, Element};

const FP8_E4M3: mkDataType_t = mkDataType_t::mkFloat8e4m3;

const BF16: mkDataType_t = mkDataType_t::mkBfloat16;

fn ring_shape() -> ring_attention::RingShape {
    ring_attention::RingShape {
        batch: 2,
        seq_local: 1024,
        heads: 16,
        kv_heads: 4,
        head_dim: 128,
        causal: true,
        nranks: 4,
    }
}

/// The error of a kernel choice for the new type: mkInvalidUsage naming it.
fn assert_no_kernel<T: std::fmt::Debug>(what: &str, r: mkernel::Result<T>) {
    let e = r.expect_err(what);
    assert_eq!(e.code, mkResult_t::mkInvalidUsage, "{what}: {}", e.message);
    assert!(e.message.contains("no kernel for this dtype (mkFloat8e4m3)"), "{what}: {}", e.message);
    assert!(e.message.contains("mkBfloat16"), "{what} names the compiled types: {}", e.message);
}

#[test]
fn planners_size_a_one_byte_type_from_its_description() {
    let fp8 = FP8_E4M3;
    assert_eq!(ag_gemm::gathered_bytes(fp8, 4096, 7168), 4096 * 7168);
    assert_eq!(ag_gemm::gathered_bytes(BF16, 4096, 7168), 2 * 4096 * 7168);
    let s = ring_shape();
    assert_eq!(ring_attention::workspace_bytes(&s, fp8), 2 * 2 * 1024 * 4 * 128);
    assert_eq!(ring_attention::workspace_bytes(&s, BF16), 2 * ring_attention::workspace_bytes(&s, fp8));
    // The backward's K/V copy, ahead of its fp32 row values and slots (which keep their size).
    let backward = ring_attention_backward::plan(&s, 132);
    let (one, two) = (
        ring_attention_backward::workspace_layout(&s, &backward, fp8),
        ring_attention_backward::workspace_layout(&s, &backward, BF16),
    );
    assert_eq!((one.kv, one.rows), (0, 2 * 2 * 1024 * 4 * 128), "K and V, one byte each");
    assert_eq!(two.rows, 2 * one.rows);
    assert_eq!(two.slots - two.rows, one.slots - one.rows);
    // A GEMM + reduction keeps its partial product in the fused-op region, in the type.
    let shape = gemm_reduce::GemmReduceShape {
        reduction: gemm_reduce::Reduction::Scatter,
        m: 4096,
        n: 8192,
        k: 1024,
        nranks: 2,
        rank: 1,
        nodes: None,
    };
    let partial = |t| gemm_reduce::plan(&shape, t, 132, None, &Tuning::default()).unwrap().op_bytes;
    assert_eq!(partial(fp8), 4096 * 8192);
    assert_eq!(partial(BF16), 2 * 4096 * 8192);
    // The collectives plan in elements of the type's size: a low-latency piece (a fixed
    // number of bytes) holds twice as many one-byte elements as two-byte ones.
    let plan = |bytes: u64| {
        collectives::plan(CollectiveKind::AllReduce, 4096, bytes, 4, 16, 64 << 20, 264, COLLECTIVE_LL_MAX_BYTES)
    };
    let (one, two) = (plan(fp8.size() as u64), plan(BF16.size() as u64));
    assert_eq!(one.chunk, 2 * two.chunk, "{one:?} {two:?}");
}

#[test]
fn every_family_reports_no_kernel_for_a_type_without_instances() {
    let fp8 = FP8_E4M3;
    let gemm = engine::plan(4096, 4096, 4096, 132, true, PlanOverrides::default());
    assert!(gemm.kernel_launch(BF16).is_ok());
    assert_no_kernel("mkGemm", gemm.kernel_launch(fp8));
    assert_no_kernel("mkAllGatherGemm", ag_gemm::kernel(fp8, 256));
    assert_no_kernel("GEMM + reduction", gemm_reduce::kernel(fp8, 256, 128, false));
    assert_no_kernel("GEMM + reduction, early sums", gemm_reduce::kernel(fp8, 256, 128, true));
    assert_no_kernel("mkMoeDispatchGemm", moe::kernel(Direction::Dispatch, fp8, 256));
    assert_no_kernel("mkMoeGemmCombine", moe::kernel(Direction::Combine, fp8, 128));
    let s = ring_shape();
    assert_no_kernel("mkRingAttention", ring_attention::plan(&s, 132, false).kernel_launch(fp8));
    assert_no_kernel("mkRingAttentionBackward", ring_attention_backward::plan(&s, 132).kernel_launch(fp8));
    assert_no_kernel("the collectives across nodes", hier::kernel(fp8));
    // Its own ops and the one-node collectives have kernels; a gather across nodes moves it
    // with the one-byte unsigned integer's kernel.
    assert!(mkernel::ops::gemm::scaled::kernel(fp8, fp8, BF16, 128, engine::Epilogue::Tma).is_ok());
    let e5m2_a = mkDataType_t::mkFloat8e5m2;
    assert!(mkernel::ops::gemm::scaled::kernel(e5m2_a, fp8, BF16, 128, engine::Epilogue::Tma).is_ok());
    assert!(mkernel::ops::dense::ag_scaled_gemm::kernel(fp8, BF16, 128).is_ok());
    assert!(mkernel::ops::dense::gemm_reduce_scaled::kernel(fp8, BF16, 128).is_ok());
    assert!(collectives::kernel(fp8).is_ok());
    assert!(hier::kernel(fp8.element().moved_across_nodes_as()).is_ok());
}

#[test]
fn a_described_type_without_a_tile_is_a_planner_error_not_a_dtype_error() {
    // bf16 has GEMM kernels, but none 96 wide: the planner asked for something no instance
    // has, which is the library's error, not the caller's dtype.
    let e = engine::gemm_kernel(BF16, 96, engine::Epilogue::Tma, engine::Cluster::None).unwrap_err();
    assert_eq!(e.code, mkResult_t::mkInternalError, "{}", e.message);
    assert!(e.message.contains("mkBfloat16"), "{}", e.message);
    assert_eq!(BF16.element().cuda_type, "__nv_bfloat16");
}

/// Every op that does not take fp8 refuses both fp8 types with mkInvalidArgument naming the
/// op, before any other rule and before any CUDA call (so this runs without a GPU); the
/// collectives take them (reductions across nodes refuse them with mkInvalidUsage).
#[test]
fn ops_without_fp8_refuse_it_by_name() {
    use mkernel::ops::dense::gemm_reduce::Reduction;
    let p = 0x10000u64;
    let dims = moe::MoeDims { tokens: 128, hidden: 128, ffn: 128, top_k: 1, experts: 2, capacity: 256, nranks: 2 };
    for fp8 in [mkDataType_t::mkFloat8e4m3, mkDataType_t::mkFloat8e5m2] {
        let d = fp8 as i32;
        let refused: [(&str, Result<(), mkernel::MkError>); 8] = [
            ("mkGemm", mkernel::ops::gemm::op::validate(p, p, p, 128, 128, 128, d).map(drop)),
            ("mkAllGatherGemm", ag_gemm::validate_args(p, p, p, 0, 128, 128, 128, d, 2, 0).map(drop)),
            ("mkGemmReduceScatter", gemm_reduce::validate(Reduction::Scatter, p, p, p, 128, 128, 128, d, 2).map(drop)),
            ("mkGemmAllReduce", gemm_reduce::validate(Reduction::All, p, p, p, 128, 128, 128, d, 2).map(drop)),
            ("mkMoeDispatchGemm", moe::validate_dispatch(p, p, p, p, p, p, dims, d).map(drop)),
            ("mkMoeGemmCombine", moe::validate_combine(p, p, p, p, p, dims, d).map(drop)),
            (
                "mkRingAttention",
                ring_attention::validate_args(p, p, p, p, p, 1, 128, 4, 4, 128, 0.1, 0, d, 2, 0).map(drop),
            ),
            (
                "mkRingAttentionBackward",
                ring_attention_backward::validate_args(p, p, p, p, p, p, p, p, p, 1, 128, 4, 4, 128, 0.1, 0, d, 2, 0)
                    .map(drop),
            ),
        ];
        for (op, r) in refused {
            let e = r.expect_err(op);
            assert_eq!(e.code, mkResult_t::mkInvalidArgument, "{op}: {}", e.message);
            assert!(e.message.contains(op) && e.message.contains(fp8.name()), "{op}: {}", e.message);
        }
        for kind in [CollectiveKind::ReduceScatter, CollectiveKind::AllReduce] {
            assert_eq!(collectives::validate(kind, p, 4 * p, 64, d, Some(0), 0, 2).unwrap().dtype, fp8);
            let e = hier::validate_across_nodes(kind, p, 4 * p, 64, d, Some(0), 0, 2).unwrap_err();
            assert_eq!(e.code, mkResult_t::mkInvalidUsage, "{}", e.message);
        }
        let gathered = collectives::validate(CollectiveKind::AllGather, p, 4 * p, 64, d, None, 0, 2).unwrap();
        assert_eq!(gathered.dtype, fp8);
    }
}
