//! One error type for the whole library, one mapping to `mkResult_t`, and the storage
//! behind `mkGetLastError`.

use std::cell::RefCell;
use std::ffi::CString;
use std::fmt;

/// Result codes, numbered as NCCL numbers `ncclResult_t`. Append only: the numbers are ABI.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum mkResult_t {
    /// The call succeeded.
    mkSuccess = 0,
    /// A CUDA call failed (driver error, launch failure, out of device memory).
    mkUnhandledCudaError = 1,
    /// A system call, socket or missing system library (e.g. no libcuda) failed.
    mkSystemError = 2,
    /// An internal invariant broke (a bug in mkernel, including a caught panic).
    mkInternalError = 3,
    /// An argument is invalid: NULL pointer, bad size, unknown enum value, misalignment.
    mkInvalidArgument = 4,
    /// The call is valid on its own but not in this state (duplicate rank, mismatched
    /// nranks, op on an aborted communicator).
    mkInvalidUsage = 5,
    /// A peer failed or aborted; this rank stopped because of it.
    mkRemoteError = 6,
    /// A non-blocking operation has not completed yet.
    mkInProgress = 7,
    /// A bounded wait expired (bootstrap, or an in-kernel wait on a peer).
    mkTimeout = 8,
}

impl mkResult_t {
    /// Maps an integer read back from the device or the wire; unknown values are internal errors.
    pub fn from_i32(v: i32) -> mkResult_t {
        use mkResult_t::*;
        match v {
            0 => mkSuccess,
            1 => mkUnhandledCudaError,
            2 => mkSystemError,
            3 => mkInternalError,
            4 => mkInvalidArgument,
            5 => mkInvalidUsage,
            6 => mkRemoteError,
            7 => mkInProgress,
            8 => mkTimeout,
            _ => mkInternalError,
        }
    }

    /// The short, static description `mkGetErrorString` returns. The reason for one failure
    /// is in `mkGetLastError`, which the descriptions name.
    pub fn description(self) -> &'static str {
        use mkResult_t::*;
        match self {
            mkSuccess => "no error",
            mkUnhandledCudaError => "unhandled cuda error (mkGetLastError says which call failed)",
            mkSystemError => "unhandled system error (mkGetLastError says why)",
            mkInternalError => "internal error - please report this issue to the mkernel developers",
            mkInvalidArgument => "invalid argument (mkGetLastError says which and why)",
            mkInvalidUsage => "invalid usage (mkGetLastError says why)",
            mkRemoteError => "remote process exited or there was a network error",
            mkInProgress => "operation in progress",
            mkTimeout => "operation timed out",
        }
    }
}

/// An error with its code and a message that says what was wrong and, where possible,
/// what to do about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MkError {
    pub code: mkResult_t,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, MkError>;

impl MkError {
    pub fn new(code: mkResult_t, message: impl Into<String>) -> Self {
        MkError { code, message: message.into() }
    }
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(mkResult_t::mkInvalidArgument, message)
    }
    pub fn invalid_usage(message: impl Into<String>) -> Self {
        Self::new(mkResult_t::mkInvalidUsage, message)
    }
    pub fn system(message: impl Into<String>) -> Self {
        Self::new(mkResult_t::mkSystemError, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(mkResult_t::mkInternalError, message)
    }
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(mkResult_t::mkTimeout, message)
    }
    pub fn remote(message: impl Into<String>) -> Self {
        Self::new(mkResult_t::mkRemoteError, message)
    }
    pub fn cuda(message: impl Into<String>) -> Self {
        Self::new(mkResult_t::mkUnhandledCudaError, message)
    }
    /// Prefixes the message with what was being done, keeping the code.
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }
}

impl fmt::Display for MkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)
    }
}

impl std::error::Error for MkError {}

impl From<std::io::Error> for MkError {
    fn from(e: std::io::Error) -> Self {
        use std::io::ErrorKind::*;
        match e.kind() {
            TimedOut | WouldBlock => MkError::timeout(e.to_string()),
            ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof => {
                MkError::remote(format!("peer connection lost: {e}"))
            }
            _ => MkError::system(e.to_string()),
        }
    }
}

/// Returns early with `mkInvalidArgument` and a formatted message unless the condition holds.
#[macro_export]
macro_rules! ensure_arg {
    ($cond:expr, $($fmt:tt)+) => {
        if !($cond) {
            return Err($crate::error::MkError::invalid_argument(format!($($fmt)+)));
        }
    };
}

thread_local! {
    /// The message of the last failed call on this thread (`mkGetLastError(NULL)`). Replaced
    /// only by the next failing call on this thread, so a pointer to it stays valid across
    /// successful calls and across `mkGetLastError` calls.
    static THREAD_LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Turns a message into a C string, replacing any NUL inside it.
pub fn c_message(message: &str) -> CString {
    CString::new(message.replace('\0', " ")).expect("NULs replaced")
}

pub fn set_thread_last_error(message: &str) {
    let message = c_message(message);
    THREAD_LAST_ERROR.with(|m| *m.borrow_mut() = message);
}

pub fn thread_last_error() -> String {
    THREAD_LAST_ERROR.with(|m| m.borrow().to_string_lossy().into_owned())
}

/// The calling thread's last error message as C reads it: valid until the next failing call
/// on this thread (or the thread's exit).
pub fn thread_last_error_ptr() -> *const std::os::raw::c_char {
    THREAD_LAST_ERROR.with(|m| m.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_codes_are_numbered_as_nccl() {
        use mkResult_t::*;
        let codes = [
            mkSuccess,
            mkUnhandledCudaError,
            mkSystemError,
            mkInternalError,
            mkInvalidArgument,
            mkInvalidUsage,
            mkRemoteError,
            mkInProgress,
            mkTimeout,
        ];
        for (i, c) in codes.iter().enumerate() {
            assert_eq!(*c as i32, i as i32);
            assert_eq!(mkResult_t::from_i32(i as i32), *c);
        }
        assert_eq!(mkResult_t::from_i32(9), mkInternalError);
        assert_eq!(mkResult_t::from_i32(-1), mkInternalError);
    }

    #[test]
    fn the_thread_message_changes_only_when_set_and_strips_nuls() {
        set_thread_last_error("first\0failure");
        let p = thread_last_error_ptr();
        assert_eq!(thread_last_error(), "first failure");
        // Reading it again hands back the same storage.
        assert_eq!(thread_last_error_ptr(), p);
        let other = std::thread::spawn(|| {
            set_thread_last_error("another thread");
            thread_last_error()
        });
        assert_eq!(other.join().unwrap(), "another thread");
        assert_eq!(thread_last_error_ptr(), p, "another thread's failure leaves this thread's message alone");
        // SAFETY: p is this thread's message, not replaced since.
        assert_eq!(unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap(), "first failure");
    }

    #[test]
    fn io_errors_map_to_timeout_and_remote() {
        let t: MkError = std::io::Error::from(std::io::ErrorKind::TimedOut).into();
        assert_eq!(t.code, mkResult_t::mkTimeout);
        let r: MkError = std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into();
        assert_eq!(r.code, mkResult_t::mkRemoteError);
    }
}
