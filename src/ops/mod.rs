//! One module per operation: argument checks, then `plan` (shape, device caps, tuning →
//! a Plan naming the kernel, grid and role split; plain Rust, tested on the CPU), then the
//! launch of that plan through the one launch path, [`launch`].

#[path = "dense/ag_gemm.rs"]
pub mod ag_gemm;
pub mod collectives;
#[path = "common/fused_fence.rs"]
pub mod fused_fence;
#[path = "gemm/engine.rs"]
pub mod gemm;
#[path = "dense/gemm_ar.rs"]
pub mod gemm_ar;
#[path = "dense/gemm_reduce.rs"]
pub mod gemm_reduce;
#[path = "dense/gemm_reduce_nodes.rs"]
pub mod gemm_reduce_nodes;
#[path = "dense/gemm_rs.rs"]
pub mod gemm_rs;
#[path = "gemm/table.rs"]
pub mod gemm_table;
#[path = "collectives/hier.rs"]
pub mod hier_collectives;
#[path = "common/launch.rs"]
pub mod launch;
#[path = "../cuda/memo.rs"]
pub mod memo;
pub mod moe;
#[path = "attention/ring_attention.rs"]
pub mod ring_attention;
#[path = "attention/ring_attention_backward.rs"]
pub mod ring_attention_backward;
#[path = "common/schedule.rs"]
pub mod schedule;
#[path = "common/util.rs"]
pub mod util;

/// Loads every kernel of the library (the tools' fatbins aside) in the current context:
/// see `cuda::preload`. For ranks that share one CUDA context (threads of one process on
/// one device): there a kernel's first load can wait for the context to go idle, that is
/// for a peer's op in flight, which waits for this rank's launch — a deadlock until the
/// timeout. The communicator's creation loads them before any of its ranks can launch.
pub fn preload_all() -> crate::error::Result<()> {
    use crate::cuda::kernels::{ALL, FATBINS};
    let kernels: Vec<_> = ALL.iter().copied().filter(|k| FATBINS.iter().any(|(file, _)| *file == k.file)).collect();
    crate::cuda::preload(&kernels)
}

/// Loads the kernels that run across nodes (hierarchical collectives, the dense fused ops) in
/// the current context: see `cuda::preload`.
pub fn preload_across_nodes() -> crate::error::Result<()> {
    let files = ["hier_collectives", "ag_gemm", "gemm_reduce"];
    let kernels: Vec<_> = crate::cuda::kernels::ALL.iter().copied().filter(|k| files.contains(&k.file)).collect();
    crate::cuda::preload(&kernels)
}
