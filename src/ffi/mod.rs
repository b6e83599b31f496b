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

// The header lists the exports in the order of these modules: lifecycle and queries first,
// then the collectives, then the fused operations and the GEMM engine. Each stands apart
// (blank line) so that formatting keeps this order.
pub mod comm;

pub mod config;

pub mod query;

pub mod collectives;

pub mod fused;

pub mod gemm;

pub mod handles;

pub mod versioned;

use crate::comm::Comm;
use crate::error::{mkResult_t, set_thread_last_error, MkError, Result};
use crate::mk_warn;
use handles::{Call, Ending, Registry};
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Opaque communicator. Create with `mkCommInitRank`, release with `mkCommDestroy` (or
/// `mkCommAbort`).
///
/// A handle is checked against the communicators alive in this process on every call: a
/// destroyed, aborted or foreign handle gives mkInvalidArgument naming it, never a crash.
/// (Each communicator keeps a few bytes for the life of the process so that its address
/// is never handed out again.)
pub struct mkComm {
    /// Gives each handle its own address; the handle's state lives in [`COMMS`].
    _distinct_address: u8,
}

impl mkComm {
    /// The communicator behind a live handle, for Rust callers (the GPU test driver). The
    /// returned value counts as a call in flight: mkCommDestroy waits for it to drop.
    ///
    /// # Panics
    /// When the handle is not live (destroyed, aborted, or not a handle).
    pub fn comm(&self) -> Call<RegisteredComm> {
        COMMS.enter(self as *const mkComm as usize).unwrap_or_else(|e| panic!("{}", e.message))
    }
}

/// Handle to a communicator.
#[allow(non_camel_case_types)]
pub type mkComm_t = *mut mkComm;

/// A communicator owned by the handle registry. Dropped inside its own CUDA context (its
/// workspace is freed there), by whoever lets go of it last.
pub struct RegisteredComm(ManuallyDrop<Comm>);

impl Deref for RegisteredComm {
    type Target = Comm;
    fn deref(&self) -> &Comm {
        &self.0
    }
}

impl Drop for RegisteredComm {
    fn drop(&mut self) {
        let context = self.0.context.enter();
        if let Err(e) = &context {
            mk_warn!(Some(self.0.rank), "releasing the communicator outside its CUDA context: {e}");
        }
        // SAFETY: dropped once, here; the field is not used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.0) };
        drop(context);
    }
}

/// Every live communicator of the process, by handle address.
pub(crate) static COMMS: Registry<RegisteredComm> = Registry::new();

/// Registers a new communicator and returns its handle.
pub(crate) fn register(comm: Comm) -> mkComm_t {
    let handle: mkComm_t = Box::leak(Box::new(mkComm { _distinct_address: 0 }));
    COMMS.insert(handle as usize, RegisteredComm(ManuallyDrop::new(comm)));
    handle
}

/// Takes a handle out of service (destroy, or abort first when `how` is Aborted): later
/// calls are refused at once; the calls inside are waited for (at most the communicator's
/// MK_TIMEOUT_MS), then the communicator is released, or, if some call is still inside,
/// released by the last such call when it returns.
pub(crate) fn end_comm(handle: mkComm_t, how: Ending) -> Result<()> {
    let closed = COMMS.close(handle as usize, how)?;
    let comm: &Comm = closed.value();
    if how == Ending::Aborted {
        comm.abort();
    }
    let bound = comm.config.timeout;
    let inside = closed.wait_for_calls(bound);
    if inside > 0 {
        mk_warn!(
            Some(comm.rank),
            "{inside} call(s) on the communicator still inside after {bound:?}; the last of them releases it"
        );
    }
    drop(closed);
    Ok(())
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

/// Runs an exported body: on failure records the message (on the comm when there is one,
/// and on the calling thread always) and logs it at WARN; converts panics. A successful
/// call leaves every message as it was.
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

/// Like [`guard`] for calls on an existing communicator: the handle must be live (NULL,
/// destroyed, aborted and foreign handles are mkInvalidArgument), it stays alive until the
/// body returns, and errors are also stored on the communicator.
pub(crate) fn with_comm(handle: mkComm_t, name: &str, body: impl FnOnce(&Comm) -> Result<()>) -> mkResult_t {
    match COMMS.enter(handle as usize) {
        Ok(call) => {
            let result = guard(Some(&call), name, || body(&call));
            // The last holder releases the communicator (a destroy on another thread may
            // have closed it meanwhile): that release must not unwind into C either.
            if catch_unwind(AssertUnwindSafe(move || drop(call))).is_err() {
                mk_warn!(None, "{name}: releasing the communicator panicked");
            }
            result
        }
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
    fn foreign_handles_are_refused_without_being_dereferenced() {
        // Not a handle: a dangling, unmapped address (dereferencing it would crash).
        let fake = 0x8 as mkComm_t;
        let r = with_comm(fake, "mkTest", |_| panic!("the body must not run"));
        assert_eq!(r, mkResult_t::mkInvalidArgument);
        assert!(
            thread_last_error().contains("mkTest: comm 0x8 is not a communicator of this library"),
            "{}",
            thread_last_error()
        );
        assert_eq!(end_comm(fake, Ending::Destroyed).unwrap_err().code, mkResult_t::mkInvalidArgument);
    }

    #[test]
    fn errors_are_recorded_for_mk_get_last_error() {
        let r = guard(None, "mkTest", || Err(MkError::invalid_argument("count is NULL")));
        assert_eq!(r, mkResult_t::mkInvalidArgument);
        assert_eq!(thread_last_error(), "mkTest: count is NULL");
        assert_eq!(guard(None, "mkTest", || Ok(())), mkResult_t::mkSuccess);
        assert_eq!(thread_last_error(), "mkTest: count is NULL", "a successful call keeps the message");
    }
}
