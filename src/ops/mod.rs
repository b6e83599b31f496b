//! The operations, by family: argument checks, then `plan` (shape, device caps, tuning → a
//! Plan naming the kernel, grid and role split; plain Rust, tested on the CPU), then the
//! launch of that plan through the one launch path, [`common::launch`].

pub mod attention;
pub mod collectives;
pub mod common;
pub mod dense;
pub mod gemm;
pub mod moe;
