//! Queries: version, communicator properties, error strings.

use super::{guard, mkComm_t, with_comm, write_out, COMMS};
use crate::error::{mkResult_t, thread_last_error_ptr};
use std::ffi::CString;
use std::os::raw::{c_char, c_int};

/// How an `mkResult_t` crosses the C boundary when C passes it in (the header shows
/// `mkResult_t`): read as an integer so an unknown value cannot be undefined behaviour.
pub type RawResult = c_int;

/// Writes the library's version as MK_VERSION(major, minor, patch).
#[no_mangle]
pub unsafe extern "C" fn mkGetVersion(version: *mut c_int) -> mkResult_t {
    guard(None, "mkGetVersion", || write_out(version, crate::version_code(), "version"))
}

/// Number of ranks in the communicator.
#[no_mangle]
pub unsafe extern "C" fn mkCommCount(comm: mkComm_t, count: *mut c_int) -> mkResult_t {
    with_comm(comm, "mkCommCount", |c| write_out(count, c.nranks as c_int, "count"))
}

/// This communicator's rank.
#[no_mangle]
pub unsafe extern "C" fn mkCommUserRank(comm: mkComm_t, rank: *mut c_int) -> mkResult_t {
    with_comm(comm, "mkCommUserRank", |c| write_out(rank, c.rank as c_int, "rank"))
}

/// The CUDA device ordinal this rank runs on.
#[no_mangle]
pub unsafe extern "C" fn mkCommCuDevice(comm: mkComm_t, device: *mut c_int) -> mkResult_t {
    with_comm(comm, "mkCommCuDevice", |c| write_out(device, c.context.device, "device"))
}

/// A static, human-readable description of a result code ("unknown result code" for
/// values this library does not define).
#[no_mangle]
pub extern "C" fn mkGetErrorString(result: RawResult) -> *const c_char {
    // Cannot fail; kept outside `guard` because it returns a string, not a result code.
    static STRINGS: std::sync::OnceLock<Vec<CString>> = std::sync::OnceLock::new();
    let strings = STRINGS.get_or_init(|| {
        (0..=9)
            .map(|i| {
                let s = if i <= 8 { mkResult_t::from_i32(i).description() } else { "unknown result code" };
                CString::new(s).expect("no NUL")
            })
            .collect()
    });
    let idx = if (0..=8).contains(&result) { result as usize } else { 9 };
    strings[idx].as_ptr()
}

/// The detailed message of the last failed call.
///
/// - `comm` non-NULL: the last failure of a call on that communicator, whichever thread
///   made it. It does not depend on the calling thread (Go and Python callers whose calls
///   move between OS threads read it this way). The string changes only when a call on
///   `comm` fails (or once, when mkCommGetAsyncError first reports an asynchronous error:
///   then it describes that error); it stays valid until then, or until the communicator
///   is destroyed. Threads sharing a communicator share this message.
/// - `comm` NULL (or a handle that is no longer live): the last failure of any call made on
///   the calling thread (init and other calls without a communicator report only here).
///   Per thread: other threads' failures never change it. It stays valid until the next
///   failing call on this thread; successful calls and mkGetLastError itself leave it as
///   it is. A caller that cannot stay on one OS thread between the failing call and this
///   one (a goroutine) pins itself first (Go: runtime.LockOSThread).
///
/// Empty ("") when there was no failure. Never NULL.
#[no_mangle]
pub unsafe extern "C" fn mkGetLastError(comm: mkComm_t) -> *const c_char {
    static EMPTY: &[u8] = b"\0";
    // Returns a string, so it has its own panic boundary: an empty string on panic.
    std::panic::catch_unwind(|| match COMMS.enter(comm as usize) {
        Ok(c) => c.last_error_ptr(),
        Err(_) => thread_last_error_ptr(),
    })
    .unwrap_or(EMPTY.as_ptr().cast())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn text(p: *const c_char) -> String {
        // SAFETY: mkGetLastError's strings are NUL-terminated.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    #[test]
    fn the_thread_message_outlives_successful_calls_and_rereads() {
        let mut v = 0;
        unsafe {
            assert_eq!(mkGetVersion(std::ptr::null_mut()), mkResult_t::mkInvalidArgument);
            let p = mkGetLastError(std::ptr::null_mut());
            assert_eq!(text(p), "mkGetVersion: version is NULL");
            // Neither a second read nor a successful call may free or change it.
            let again = mkGetLastError(std::ptr::null_mut());
            assert_eq!(again, p);
            assert_eq!(mkGetVersion(&mut v), mkResult_t::mkSuccess);
            assert_eq!(text(p), "mkGetVersion: version is NULL");
            assert_eq!(mkGetLastError(std::ptr::null_mut()), p);
            // A foreign handle reads the thread's message too (after failing itself).
            assert_eq!(mkCommCount(0x10 as mkComm_t, &mut v), mkResult_t::mkInvalidArgument);
            assert!(text(mkGetLastError(0x10 as mkComm_t)).contains("mkCommCount: comm 0x10 is not a communicator"));
        }
    }
}
