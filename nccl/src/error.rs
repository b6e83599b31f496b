//! The one error type, its mapping from mkernel's errors, the panic boundary every export
//! runs in, and the storage behind `ncclGetLastError`.

use crate::abi::*;
use mkernel::{mkResult_t, MkError};
use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// An error with an `ncclResult_t` and a message naming the rule that was broken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclError {
    pub code: ncclResult_t,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, NcclError>;

impl NcclError {
    pub fn new(code: ncclResult_t, message: impl Into<String>) -> Self {
        NcclError { code, message: message.into() }
    }
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ncclInvalidArgument, message)
    }
    pub fn invalid_usage(message: impl Into<String>) -> Self {
        Self::new(ncclInvalidUsage, message)
    }
    pub fn system(message: impl Into<String>) -> Self {
        Self::new(ncclSystemError, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ncclInternalError, message)
    }
}

/// mkernel's codes are NCCL's numbers, except `mkTimeout`, which NCCL 2.28 lacks: a peer
/// that did not arrive in time is a remote failure to this rank, so it is `ncclRemoteError`
/// (the message still says "timed out").
pub fn code_of(code: mkResult_t) -> ncclResult_t {
    match code {
        mkResult_t::mkTimeout => ncclRemoteError,
        c => c as ncclResult_t,
    }
}

impl From<MkError> for NcclError {
    fn from(e: MkError) -> Self {
        NcclError { code: code_of(e.code), message: e.message }
    }
}

/// NCCL's text for each result code; where NCCL points at NCCL_DEBUG, these point at
/// `ncclGetLastError`, which already holds the failed call's reason.
pub fn error_string(code: ncclResult_t) -> &'static std::ffi::CStr {
    match code {
        ncclSuccess => c"no error",
        ncclUnhandledCudaError => c"unhandled cuda error (ncclGetLastError says which call failed)",
        ncclSystemError => c"unhandled system error (ncclGetLastError says why)",
        ncclInternalError => c"internal error - please report this issue to the mkernel developers",
        ncclInvalidArgument => c"invalid argument (ncclGetLastError says which and why)",
        ncclInvalidUsage => c"invalid usage (ncclGetLastError says why)",
        ncclRemoteError => c"remote process exited or there was a network error",
        ncclInProgress => c"NCCL operation in progress",
        _ => c"unknown result code",
    }
}

thread_local! {
    /// The message of this thread's last failed call, for `ncclGetLastError(NULL)`.
    static THREAD_LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// Whether this thread's last failed call failed inside the real NCCL (interpose mode),
    /// so `ncclGetLastError` asks it.
    static LAST_ERROR_IS_REAL: Cell<bool> = const { Cell::new(false) };
}

pub fn to_cstring(message: &str) -> CString {
    CString::new(message.replace('\0', " ")).unwrap_or_default()
}

pub fn set_thread_last_error(message: &str) {
    THREAD_LAST_ERROR.with(|m| *m.borrow_mut() = to_cstring(message));
    LAST_ERROR_IS_REAL.with(|r| r.set(false));
}

/// Records that the real NCCL returned `code` to a forwarded call.
pub fn note_real_result(code: ncclResult_t) {
    if code != ncclSuccess && code != ncclInProgress {
        LAST_ERROR_IS_REAL.with(|r| r.set(true));
    }
}

pub fn last_error_is_real() -> bool {
    LAST_ERROR_IS_REAL.with(|r| r.get())
}

/// Pointer to this thread's last message; valid until the thread's next failure.
pub fn thread_last_error_ptr() -> *const std::os::raw::c_char {
    THREAD_LAST_ERROR.with(|m| m.borrow().as_ptr())
}

pub fn thread_last_error() -> String {
    THREAD_LAST_ERROR.with(|m| m.borrow().to_string_lossy().into_owned())
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

/// Runs an exported body: a panic becomes `ncclInternalError`; an error is logged at WARN,
/// stored for `ncclGetLastError` (on the thread, and through `on_error` on a communicator)
/// and returned as its code. `Ok(code)` passes through (ncclSuccess, ncclInProgress, or the
/// real NCCL's own result for a forwarded call).
pub fn guard(name: &str, on_error: impl FnOnce(&str), body: impl FnOnce() -> Result<ncclResult_t>) -> ncclResult_t {
    let outcome = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(p) => Err(NcclError::internal(format!("panic inside {name}: {}", panic_message(&p)))),
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            let message = format!("{name}: {}", e.message);
            mkernel::mk_warn!(None, "{message} (ncclResult_t {})", e.code);
            set_thread_last_error(&message);
            on_error(&message);
            e.code
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_and_errors_become_codes_with_messages() {
        let r = guard("ncclTest", |_| {}, || panic!("boom {}", 3));
        assert_eq!(r, ncclInternalError);
        assert!(thread_last_error().contains("panic inside ncclTest: boom 3"));
        let mut seen = String::new();
        let r = guard("ncclTest", |m| seen = m.to_string(), || Err(NcclError::invalid_usage("no")));
        assert_eq!((r, seen.as_str()), (ncclInvalidUsage, "ncclTest: no"));
        assert_eq!(guard("ncclTest", |_| {}, || Ok(ncclInProgress)), ncclInProgress);
    }

    #[test]
    fn timeouts_map_to_remote_error_and_the_rest_keep_their_number() {
        assert_eq!(code_of(mkResult_t::mkTimeout), ncclRemoteError);
        assert_eq!(code_of(mkResult_t::mkInvalidUsage), ncclInvalidUsage);
        assert_eq!(code_of(mkResult_t::mkInProgress), ncclInProgress);
        let e: NcclError = MkError::timeout("peer late").into();
        assert_eq!((e.code, e.message.as_str()), (ncclRemoteError, "peer late"));
        assert_eq!(error_string(99).to_str().unwrap(), "unknown result code");
    }
}
