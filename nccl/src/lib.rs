//! libmkernel-nccl: NCCL's C API (nccl.h of NCCL 2.28.9, exactly) over mkernel, for programs
//! that already call NCCL (PyTorch's ProcessGroupNCCL, nccl-tests, vLLM's pynccl).
//!
//! Two modes, chosen at the first call (`real`): interpose, where each `ncclComm_t` wraps a
//! real NCCL communicator and an mkernel one and AllReduce / AllGather / ReduceScatter run
//! on mkernel; and standalone, with no NCCL at all. docs/nccl.md is the user's manual.
//!
//! `exports` holds every `#[no_mangle]` function; nccl/exports.map keeps everything else
//! (mkernel's own mk* symbols included) out of the shared library's dynamic symbol table.

// NCCL's own names (ncclSuccess, ncclComm_t, ...) are kept as C spells them.
#![allow(non_upper_case_globals, non_camel_case_types)]

pub mod abi;
pub mod collectives;
pub mod error;
pub mod exports;
pub mod group;
pub mod handle;
pub mod init;
pub mod real;
