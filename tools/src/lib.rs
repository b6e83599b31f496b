//! What mkernel's GPU test driver (`mktest`), benchmarks (`mkbench`) and tests share, kept
//! out of the library's crate so that none of it ships in libmkernel.so: host conversions and
//! float64 acceptance rules (`testing`), the cuBLASLt reference and baseline (`cublaslt`),
//! the in-memory RDMA fabric the transport's tests run over (`rdma_sim`), and the GPU checks
//! of the proxy ring's device side (`device_check`). It reaches the library's layers through
//! mkernel's `internals` feature.

// A `CUstream` is an opaque driver handle that Rust code only hands back to the driver (as
// in the library's crate, whose lib.rs says why this lint does not fit).
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod cublaslt;
pub mod device_check;
pub mod rdma_sim;
pub mod testing;
