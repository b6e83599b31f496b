#![allow(non_snake_case, non_camel_case_types)]
// The exported functions' safety contract (which pointers may be NULL, what they must point
// to, for how long) is written in each doc comment's argument list, which cbindgen copies
// into the header, the reference C callers read; a Rust-only `# Safety` heading would repeat it.
#![allow(clippy::missing_safety_doc)]
//! The C ABI. This is the only module with `#[no_mangle]`; each file is one section of
//! include/mkernel.h, and the doc comments on these items are the header's manual.
//!
//! Every exported body runs inside [`guard`]: errors become an `mkResult_t` plus a message
//! for `mkGetLastError`, and a panic becomes `mkInternalError` instead of unwinding into C.

pub mod collectives;
pub mod comm;
pub mod config;
pub mod fused;
pub mod gemm;
pub mod query;

use crate::comm::Comm;
use crate::error::{mkResult_t, set_thread_last_error, MkError, Result};
use crate::mk_warn;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Opaque communicator. Create with `mkCommInitRank`, release with `mkCommDestroy`.
pub struct mkComm {
    pub(crate) comm: Comm,
}

impl mkComm {
    /// The communicator behind a handle, for Rust callers (the GPU test driver).
    pub fn comm(&self) -> &Comm {
        &self.comm
    }
}

/// Handle to a communicator.
#[allow(non_camel_case_types)]
pub type mkComm_t = *mut mkComm;

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

/// Runs an exported body: records the error message (on the comm when there is one, and
/// on the calling thread always), logs it at WARN, and converts panics.
pub(crate) fn guard(comm: Option<&Comm>, name: &str, body: impl FnOnce() -> Result<()>) -> mkResult_t {
    let outcome = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(p) => Err(MkError::internal(format!("panic inside {name}: {}", panic_message(&p)))),
    };
    match outcome {
        Ok(()) => mkResult_t::mkSuccess,
        Err(e) => {
            let message = format!("{name}: {}", e.message);
            mk_warn!(comm.map(|c| c.rank), "{message} ({:?})", e.code);
            set_thread_last_error(&message);
            if let Some(c) = comm {
                c.set_last_error(&message);
            }
            e.code
        }
    }
}

/// Borrows the communicator behind a handle, or fails with `mkInvalidArgument` on NULL.
///
/// # Safety
/// A non-NULL handle must come from `mkCommInitRank*` and not be destroyed yet.
pub(crate) unsafe fn comm_ref<'a>(handle: mkComm_t) -> Result<&'a Comm> {
    handle
        .as_ref()
        .map(|h| &h.comm)
        .ok_or_else(|| MkError::invalid_argument("comm is NULL"))
}

/// Like [`guard`] for calls on an existing communicator: NULL is rejected, and errors are
/// also stored on the communicator.
///
/// # Safety
/// As for [`comm_ref`].
pub(crate) unsafe fn with_comm(handle: mkComm_t, name: &str, body: impl FnOnce(&Comm) -> Result<()>) -> mkResult_t {
    match comm_ref(handle) {
        Ok(c) => guard(Some(c), name, || body(c)),
        Err(e) => guard(None, name, || Err(e)),
    }
}

/// Writes `value` through an out-pointer, rejecting NULL.
///
/// # Safety
/// A non-NULL `out` must be valid for one write of T.
pub(crate) unsafe fn write_out<T>(out: *mut T, value: T, what: &str) -> Result<()> {
    if out.is_null() {
        return Err(MkError::invalid_argument(format!("{what} is NULL")));
    }
    out.write(value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::thread_last_error;

    #[test]
    fn a_panic_becomes_internal_error_with_a_message() {
        let r = guard(None, "mkTest", || panic!("boom {}", 7));
        assert_eq!(r, mkResult_t::mkInternalError);
        assert!(thread_last_error().contains("panic inside mkTest: boom 7"));
    }

    #[test]
    fn errors_are_recorded_for_mk_get_last_error() {
        let r = guard(None, "mkTest", || Err(MkError::invalid_argument("count is NULL")));
        assert_eq!(r, mkResult_t::mkInvalidArgument);
        assert_eq!(thread_last_error(), "mkTest: count is NULL");
        assert_eq!(guard(None, "mkTest", || Ok(())), mkResult_t::mkSuccess);
    }
}
