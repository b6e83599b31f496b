//! Queries: version, communicator properties, error strings.

use super::{with_comm, write_out, guard, mkComm_t, comm_ref};
use crate::error::{mkResult_t, thread_last_error};
use std::cell::RefCell;
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

thread_local! {
    static LAST_ERROR_BUFFER: RefCell<CString> = RefCell::new(CString::default());
}

/// The detailed message of the last failed call: on `comm` when it is non-NULL, else of
/// the calling thread (calls that had no communicator yet, such as init). The string
/// stays valid until the next failing call on the same comm or thread. Empty when none.
#[no_mangle]
pub unsafe extern "C" fn mkGetLastError(comm: mkComm_t) -> *const c_char {
    static EMPTY: &[u8] = b"\0";
    // Returns a string, so it has its own panic boundary: an empty string on panic.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if let Ok(c) = comm_ref(comm) {
            return c.last_error_ptr();
        }
        LAST_ERROR_BUFFER.with(|b| {
            let msg = thread_last_error().replace('\0', " ");
            *b.borrow_mut() = CString::new(msg).unwrap_or_default();
            b.borrow().as_ptr()
        })
    }))
    .unwrap_or(EMPTY.as_ptr().cast())
}
