//! mkernel: fused communication + compute CUDA kernels behind an NCCL-shaped C ABI.
//!
//! Layout (docs/architecture.md): `ffi` is the C ABI (the only `#[no_mangle]` code), `error`
//! the one error type, `types` the element types and reduction ops, `bootstrap` the
//! authenticated rendezvous and host collectives, `comm` the communicator, `transport` the
//! inter-node transports, `cuda` the driver layer and embedded kernels, `ops` the
//! operations (validation, planning, launch).
//!
//! The crate's Rust interface is the C ABI and the types the header is generated from
//! (`ffi`, `error`, `types`, which cbindgen reads). The other layers are public only with the
//! feature `internals`, which the workspace's own crates enable (mkernel-nccl, the tools'
//! mkernel-tools) and this package's tests; the shared library exports the same `mk*`
//! symbols either way (docs/decisions/0061).

// A `CUstream` is an opaque driver handle that Rust code only hands back to the driver and
// never dereferences; its validity is the caller's contract, as in every CUDA API (and as
// in the C ABI that wraps these functions). Marking each launcher `unsafe` for it would
// say nothing more.
#![allow(clippy::not_unsafe_ptr_arg_deref)]
// Without `internals`, items only the workspace's crates call (the tools' helpers among
// them) are unreachable from the C ABI; with it (every workspace build, and the lint gate)
// they are public and the lint sees what it always did.
#![cfg_attr(not(feature = "internals"), allow(dead_code, unused_imports))]

pub mod error;
pub mod ffi;
pub mod types;

// Each layer written out as its two declarations rather than by a macro: cbindgen follows
// `mod` items as written to find the header's types, and tests/layers.rs reads these lines
// to check the gate.

#[cfg(feature = "internals")]
pub mod bootstrap;
#[cfg(not(feature = "internals"))]
mod bootstrap;
#[cfg(feature = "internals")]
pub mod comm;
#[cfg(not(feature = "internals"))]
mod comm;
#[cfg(feature = "internals")]
pub mod cuda;
#[cfg(not(feature = "internals"))]
mod cuda;
#[cfg(feature = "internals")]
pub mod env;
#[cfg(not(feature = "internals"))]
mod env;
#[cfg(feature = "internals")]
pub mod kernel_abi;
#[cfg(not(feature = "internals"))]
mod kernel_abi;
#[cfg(feature = "internals")]
pub mod log;
#[cfg(not(feature = "internals"))]
mod log;
#[cfg(feature = "internals")]
pub mod ops;
#[cfg(not(feature = "internals"))]
mod ops;
#[cfg(feature = "internals")]
pub mod transport;
#[cfg(not(feature = "internals"))]
mod transport;
#[cfg(feature = "internals")]
pub mod tuning;
#[cfg(not(feature = "internals"))]
mod tuning;

pub use error::{mkResult_t, MkError, Result};

/// MK_VERSION(major, minor, patch) of this build, as the header's MK_VERSION_CODE.
pub fn version_code() -> i32 {
    let p = |s: &str| s.parse::<i32>().expect("numeric version");
    p(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
        + p(env!("CARGO_PKG_VERSION_MINOR")) * 100
        + p(env!("CARGO_PKG_VERSION_PATCH"))
}
