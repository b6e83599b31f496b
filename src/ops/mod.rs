//! One module per operation: argument checks, then `plan` (shape, device caps, tuning →
//! a Plan naming the kernel, grid and role split; plain Rust, tested on the CPU), then the
//! launch of that plan through the one launch path, [`launch`].

pub mod ag_gemm;
pub mod collectives;
pub mod fused_fence;
pub mod gemm;
pub mod gemm_ar;
pub mod gemm_reduce;
pub mod gemm_reduce_nodes;
pub mod gemm_rs;
pub mod gemm_table;
pub mod hier_collectives;
pub mod launch;
pub mod memo;
pub mod moe;
pub mod ring_attention;
pub mod ring_attention_backward;
pub mod schedule;
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
