//! Standalone mode through the exported functions, without a GPU: communicators whose
//! mkernel side is still being made (a non-blocking init) or failed, driven through
//! ncclCommGetAsyncError, groups and ncclCommAbort from another thread.

use mkernel_nccl::abi::*;
use mkernel_nccl::error::NcclError;
use mkernel_nccl::exports::*;
use mkernel_nccl::handle::{register, CommHandle, MkSlot};
use std::ffi::CStr;
use std::ptr::null_mut;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn standalone() {
    std::env::set_var("MK_NCCL_MODE", "standalone");
    let mut v = 0;
    assert_eq!(unsafe { ncclGetVersion(&mut v) }, ncclSuccess);
    assert_eq!(v, NCCL_VERSION_CODE);
}

/// A registered communicator of `nranks` whose init has not finished.
fn pending(nranks: usize) -> (Arc<CommHandle>, ncclComm_t) {
    let h = CommHandle::new(0, nranks, 0, false, None);
    let c = register(h.clone());
    (h, c)
}

fn last_error() -> String {
    unsafe { CStr::from_ptr(ncclGetLastError(null_mut())) }.to_string_lossy().into_owned()
}

fn async_error(c: ncclComm_t) -> ncclResult_t {
    let mut e = -1;
    assert_eq!(unsafe { ncclCommGetAsyncError(c, &mut e) }, ncclSuccess);
    e
}

#[test]
fn async_error_is_in_progress_until_a_nonblocking_init_ends() {
    standalone();
    let (h, c) = pending(2);
    assert_eq!(async_error(c), ncclInProgress);
    let (mut n, mut r) = (0, -1);
    assert_eq!(unsafe { ncclCommCount(c, &mut n) }, ncclSuccess, "queries answer while the init runs");
    assert_eq!(unsafe { ncclCommUserRank(c, &mut r) }, ncclSuccess);
    assert_eq!((n, r), (2, 0));
    h.settle(MkSlot::Failed(NcclError::system("the CUDA driver library could not be loaded")));
    assert_eq!(async_error(c), ncclSystemError, "then the init's own error");
    let x = 0x10000 as *mut std::ffi::c_void;
    assert_eq!(unsafe { ncclAllReduce(x, x, 4, 7, ncclSum, c, null_mut()) }, ncclSystemError);
    assert!(last_error().contains("could not be loaded"), "{}", last_error());
    assert_eq!(unsafe { ncclCommDestroy(c) }, ncclSuccess);
    assert_eq!(unsafe { ncclCommDestroy(c) }, ncclInvalidArgument, "destroyed once");
}

#[test]
fn a_group_holds_collectives_until_its_end_and_reports_their_errors() {
    standalone();
    let (h, c) = pending(2);
    let x = 0x10000 as *mut std::ffi::c_void;
    assert_eq!(ncclGroupStart(), ncclSuccess);
    // Checked at the call: an operator mkernel does not run, a root that is no rank.
    assert_eq!(unsafe { ncclAllReduce(x, x, 4, 7, 5, c, null_mut()) }, ncclInvalidArgument);
    assert!(last_error().contains("op 5 is not a built-in ncclRedOp_t"), "{}", last_error());
    assert_eq!(unsafe { ncclBroadcast(x, x, 4, 7, 2, c, null_mut()) }, ncclInvalidArgument);
    assert!(last_error().contains("root 2 is not a rank"), "{}", last_error());
    // Held: returns at once although the communicator is not ready (fp8 reductions too).
    assert_eq!(unsafe { ncclAllReduce(x, x, 4, ncclFloat8e4m3, ncclSum, c, null_mut()) }, ncclSuccess);
    assert_eq!(
        unsafe {
            ncclAllReduce(x, x, 4, 7, 4 /* ncclAvg */, c, null_mut())
        },
        ncclSuccess
    );
    assert_eq!(
        unsafe {
            ncclReduce(x, x, 4, 9, 2 /* ncclMax */, 1, c, null_mut())
        },
        ncclSuccess
    );
    let h2 = h.clone();
    let settle = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        h2.settle(MkSlot::Failed(NcclError::new(ncclRemoteError, "rank 1 never joined")));
    });
    // The group's end waits for the init, then reports the first grouped failure.
    assert_eq!(ncclGroupEnd(), ncclRemoteError);
    assert!(last_error().contains("a grouped collective failed: rank 1 never joined"), "{}", last_error());
    settle.join().unwrap();
    assert_eq!(ncclGroupEnd(), ncclInvalidUsage, "the group is closed");
    assert_eq!(unsafe { ncclCommDestroy(c) }, ncclSuccess);
}

#[test]
fn abort_from_another_thread_releases_a_call_waiting_for_the_init() {
    standalone();
    let (h, c) = pending(2);
    let c_addr = c as usize;
    let waiter = std::thread::spawn(move || {
        let x = 0x10000 as *mut std::ffi::c_void;
        let started = Instant::now();
        let r = unsafe { ncclAllGather(x, x, 4, 7, c_addr as ncclComm_t, null_mut()) };
        (r, started.elapsed())
    });
    // The waiter holds the handle (a third reference, beside `h` and the registry's) from
    // its lookup until it returns: aborted from then on, the call cannot miss the handle.
    // (A fixed pause could end before the waiter starts on a loaded machine, and the call
    // would then find no handle at all.)
    let start = Instant::now();
    while Arc::strong_count(&h) < 3 {
        assert!(start.elapsed() < Duration::from_secs(20), "the waiter never looked the communicator up");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20)); // most often inside the wait by now
    assert_eq!(unsafe { ncclCommAbort(c) }, ncclSuccess);
    let (r, waited) = waiter.join().unwrap();
    assert_eq!(r, ncclInvalidUsage, "the waiting call learns the communicator was aborted");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert!(h.aborted.load(std::sync::atomic::Ordering::Acquire));
    assert_eq!(unsafe { ncclCommAbort(c) }, ncclInvalidArgument, "the handle is gone");
    // An init that ends after the abort keeps nothing.
    h.settle(MkSlot::Failed(NcclError::system("late")));
    assert!(h.off_reason().is_some());
}
