//! mkernel: fused communication + compute CUDA kernels behind an NCCL-shaped C ABI.
//!
//! Layout (see README.md and DESIGN notes): `ffi` is the C ABI (the only `#[no_mangle]`
//! code), `error` the one error type, `bootstrap` the authenticated rendezvous and host
//! collectives, `comm` the communicator, `cuda` the driver layer and embedded kernels,
//! `ops` one module per operation (validation, planning, launch).

// A `CUstream` is an opaque driver handle that Rust code only hands back to the driver and
// never dereferences; its validity is the caller's contract, as in every CUDA API (and as
// in the C ABI that wraps these functions). Marking each launcher `unsafe` for it would
// say nothing more.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod bootstrap;
pub mod comm;
pub mod cublaslt;
pub mod cuda;
pub mod env;
pub mod error;
pub mod ffi;
pub mod kernel_abi;
pub mod log;
pub mod ops;
pub mod testing;
pub mod transport;
pub mod tuning;
pub mod types;

pub use error::{mkResult_t, MkError, Result};

/// MK_VERSION(major, minor, patch) of this build, as the header's MK_VERSION_CODE.
pub fn version_code() -> i32 {
    let p = |s: &str| s.parse::<i32>().expect("numeric version");
    p(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
        + p(env!("CARGO_PKG_VERSION_MINOR")) * 100
        + p(env!("CARGO_PKG_VERSION_PATCH"))
}
