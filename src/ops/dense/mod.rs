//! The dense fused ops: a GEMM fused with the collective before it (AllGather + GEMM) or
//! after it (GEMM + ReduceScatter, GEMM + AllReduce), on one node or across nodes; their fp8
//! forms (scaled e4m3 operands) on one node.

pub mod ag_gemm;
pub mod ag_scaled_gemm;
pub mod gemm_ar;
pub mod gemm_reduce;
pub mod gemm_reduce_nodes;
pub mod gemm_reduce_scaled;
pub mod gemm_rs;
