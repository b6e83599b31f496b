//! One module per operation: argument checks and planning in plain Rust (tested on the
//! CPU), then the launch.

pub mod collectives;
pub mod gemm;
pub mod ag_gemm;
pub mod gemm_ar;
pub mod gemm_reduce;
pub mod gemm_rs;
pub mod hier_collectives;
pub mod moe;
pub mod ring_attention;
pub mod util;
