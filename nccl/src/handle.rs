//! What an `ncclComm_t` points to: a registered, reference-counted communicator record.
//!
//! A handle is `Arc::into_raw` of a [`CommHandle`], and a registry keeps the live ones, so a
//! destroyed, aborted or foreign pointer is refused with `ncclInvalidArgument` instead of
//! being dereferenced, and a call in flight on another thread keeps its own reference while
//! `ncclCommAbort` or `ncclCommDestroy` releases the handle's.

use crate::abi::*;
use crate::error::{to_cstring, NcclError, Result};
use mkernel::comm::Comm;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// An mkernel communicator that is released inside its device context (as mkCommDestroy does).
pub struct MkComm(ManuallyDrop<Comm>);

impl MkComm {
    pub fn new(c: Comm) -> Self {
        MkComm(ManuallyDrop::new(c))
    }
}

impl std::ops::Deref for MkComm {
    type Target = Comm;
    fn deref(&self) -> &Comm {
        &self.0
    }
}

impl Drop for MkComm {
    fn drop(&mut self) {
        let guard = self.0.context.enter();
        // SAFETY: dropped once, here.
        unsafe { ManuallyDrop::drop(&mut self.0) };
        drop(guard);
    }
}

/// The mkernel side of a communicator.
pub enum MkSlot {
    /// Being created (standalone init, or the interpose attach, still running).
    Pending,
    Ready(Arc<MkComm>),
    /// Standalone: the init failed; the communicator reports this error.
    Failed(NcclError),
    /// Interpose: no mkernel communicator (why); every call goes to the real NCCL.
    Off(String),
}

/// The calls that are counted per communicator, by where they ran.
pub const COUNTED: [&str; 10] =
    ["AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "Send", "Recv", "AlltoAll", "Gather", "Scatter"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Mkernel = 0,
    Nccl = 1,
}

pub struct CommHandle {
    pub rank: usize,
    pub nranks: usize,
    pub device: i32,
    pub blocking: bool,
    /// Interpose mode: the real NCCL communicator this one wraps, counted as wrapped while
    /// this handle exists.
    pub real: Option<usize>,
    _wrapping: Option<Wrapping>,
    mk: Mutex<MkSlot>,
    mk_settled: Condvar,
    /// ncclCommFinalize in progress (non-blocking communicators).
    pub finalizing: AtomicBool,
    pub finalized: AtomicBool,
    pub aborted: AtomicBool,
    last_error: Mutex<CString>,
    counts: [[AtomicU64; 2]; COUNTED.len()],
}

impl CommHandle {
    pub fn new(rank: usize, nranks: usize, device: i32, blocking: bool, real: Option<usize>) -> Arc<CommHandle> {
        Arc::new(CommHandle {
            rank,
            nranks,
            device,
            blocking,
            real,
            _wrapping: real.map(|r| Wrapping::new(r as ncclComm_t)),
            mk: Mutex::new(MkSlot::Pending),
            mk_settled: Condvar::new(),
            finalizing: AtomicBool::new(false),
            finalized: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            last_error: Mutex::new(CString::default()),
            counts: Default::default(),
        })
    }

    /// The real NCCL communicator (interpose mode).
    pub fn real_comm(&self) -> ncclComm_t {
        self.real.unwrap_or(0) as ncclComm_t
    }

    pub fn settle(&self, slot: MkSlot) {
        let mut s = self.mk.lock();
        // An aborted communicator keeps no mkernel side, even one that finished late.
        *s = if self.aborted.load(Ordering::Acquire) {
            if let MkSlot::Ready(c) = &slot {
                c.abort();
            }
            MkSlot::Off("aborted".into())
        } else {
            slot
        };
        self.mk_settled.notify_all();
    }

    pub fn is_pending(&self) -> bool {
        matches!(*self.mk.lock(), MkSlot::Pending)
    }

    /// Waits until the mkernel side is settled, then returns its communicator: `Ok(None)`
    /// when it is off (interpose), the init's error when it failed (standalone).
    pub fn mk_comm(&self) -> Result<Option<Arc<MkComm>>> {
        let mut s = self.mk.lock();
        while matches!(*s, MkSlot::Pending) {
            self.mk_settled.wait(&mut s);
        }
        match &*s {
            MkSlot::Ready(c) => Ok(Some(c.clone())),
            MkSlot::Failed(e) => Err(e.clone()),
            MkSlot::Off(_) => Ok(None),
            MkSlot::Pending => unreachable!("waited above"),
        }
    }

    /// The mkernel side if it is settled, without waiting (None while pending).
    pub fn mk_state(&self) -> Option<std::result::Result<Option<Arc<MkComm>>, NcclError>> {
        match &*self.mk.lock() {
            MkSlot::Pending => None,
            MkSlot::Ready(c) => Some(Ok(Some(c.clone()))),
            MkSlot::Failed(e) => Some(Err(e.clone())),
            MkSlot::Off(_) => Some(Ok(None)),
        }
    }

    /// Takes the mkernel communicator out (destroy, abort), leaving the slot off.
    pub fn take_mk(&self, why: &str) -> Option<Arc<MkComm>> {
        let taken = std::mem::replace(&mut *self.mk.lock(), MkSlot::Off(why.into()));
        // A call waiting for a pending init returns now (and finds the communicator gone).
        self.mk_settled.notify_all();
        match taken {
            MkSlot::Ready(c) => Some(c),
            _ => None,
        }
    }

    pub fn off_reason(&self) -> Option<String> {
        match &*self.mk.lock() {
            MkSlot::Off(why) => Some(why.clone()),
            _ => None,
        }
    }

    pub fn set_last_error(&self, message: &str) {
        *self.last_error.lock() = to_cstring(message);
    }

    /// This communicator's last message; valid until its next failure.
    pub fn last_error_ptr(&self) -> *const std::os::raw::c_char {
        self.last_error.lock().as_ptr()
    }

    pub fn count(&self, call: &str, route: Route) {
        if let Some(i) = COUNTED.iter().position(|c| *c == call) {
            self.counts[i][route as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn counted(&self, call: &str, route: Route) -> u64 {
        COUNTED.iter().position(|c| *c == call).map_or(0, |i| self.counts[i][route as usize].load(Ordering::Relaxed))
    }

    /// "on mkernel: AllReduce 12, AllGather 3; on NCCL: Broadcast 2" (calls never made left out).
    pub fn counts_line(&self) -> String {
        let side = |route: Route| {
            let parts: Vec<String> = COUNTED
                .iter()
                .filter_map(|c| Some(self.counted(c, route)).filter(|&n| n > 0).map(|n| format!("{c} {n}")))
                .collect();
            if parts.is_empty() {
                "none".to_string()
            } else {
                parts.join(", ")
            }
        };
        format!("on mkernel: {}; on NCCL: {}", side(Route::Mkernel), side(Route::Nccl))
    }
}

static LIVE: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

/// The real communicators wrapped by handles that exist (registered or not yet, and until
/// the last reference, so through the real ncclCommDestroy), with how many handles wrap
/// each: an address the real NCCL frees and reuses may briefly have two.
static WRAPPED_REAL: Mutex<Option<HashMap<usize, usize>>> = Mutex::new(None);

fn note_wrapped(real: usize) {
    *WRAPPED_REAL.lock().get_or_insert_with(HashMap::new).entry(real).or_insert(0) += 1;
}

fn note_unwrapped(real: usize) {
    let mut wrapped = WRAPPED_REAL.lock();
    if let Some(map) = wrapped.as_mut() {
        if let Some(n) = map.get_mut(&real) {
            *n -= 1;
            if *n == 0 {
                map.remove(&real);
            }
        }
    }
}

/// Whether `comm` is a real NCCL communicator that one of this library's handles wraps
/// (interpose mode), as opposed to a handle of ours or a foreign pointer.
pub fn wraps_real(comm: ncclComm_t) -> bool {
    WRAPPED_REAL.lock().as_ref().is_some_and(|m| m.contains_key(&(comm as usize)))
}

/// A real communicator counted as wrapped while this value lives: held by the handle that
/// wraps it, and before that handle exists while this library queries it (a split's child:
/// the real queries call back into `ncclCommGetAsyncError`).
pub struct Wrapping(usize);

impl Wrapping {
    pub fn new(real: ncclComm_t) -> Wrapping {
        note_wrapped(real as usize);
        Wrapping(real as usize)
    }
}

impl Drop for Wrapping {
    fn drop(&mut self) {
        note_unwrapped(self.0);
    }
}

/// Registers a handle and returns the pointer C gets.
pub fn register(h: Arc<CommHandle>) -> ncclComm_t {
    let p = Arc::into_raw(h) as usize;
    LIVE.lock().get_or_insert_with(HashSet::new).insert(p);
    p as ncclComm_t
}

/// The communicator behind a pointer C passed, or `ncclInvalidArgument`.
pub fn lookup(comm: ncclComm_t) -> Result<Arc<CommHandle>> {
    if comm.is_null() {
        return Err(NcclError::invalid_argument("comm is NULL"));
    }
    let live = LIVE.lock();
    if !live.as_ref().is_some_and(|s| s.contains(&(comm as usize))) {
        return Err(NcclError::invalid_argument(format!(
            "comm {comm:p} is not a live communicator (already destroyed or aborted, or not made by this library)"
        )));
    }
    // SAFETY: registered pointers come from Arc::into_raw and hold one reference until
    // `unregister`; the registry lock keeps that from happening concurrently.
    unsafe {
        Arc::increment_strong_count(comm as *const CommHandle);
        Ok(Arc::from_raw(comm as *const CommHandle))
    }
}

/// Removes a handle from the registry and returns the registry's reference.
pub fn unregister(comm: ncclComm_t) -> Result<Arc<CommHandle>> {
    let h = lookup(comm)?;
    let mut live = LIVE.lock();
    if !live.as_mut().is_some_and(|s| s.remove(&(comm as usize))) {
        return Err(NcclError::invalid_argument(format!("comm {comm:p} was destroyed by another thread")));
    }
    drop(live);
    // SAFETY: drops the reference the registry held (taken in `register`).
    unsafe { Arc::decrement_strong_count(comm as *const CommHandle) };
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_refuses_null_dead_and_foreign_pointers() {
        let h = CommHandle::new(0, 2, 0, true, None);
        let p = register(h.clone());
        assert_eq!(lookup(p).unwrap().nranks, 2);
        assert_eq!(lookup(std::ptr::null_mut()).err().unwrap().code, ncclInvalidArgument);
        let foreign = 0x1234 as ncclComm_t;
        assert!(lookup(foreign).err().unwrap().message.contains("not a live communicator"));
        let taken = unregister(p).unwrap();
        assert!(lookup(p).is_err(), "a destroyed handle is refused");
        assert!(unregister(p).is_err(), "destroying twice is refused");
        assert_eq!(Arc::strong_count(&taken), 2, "the caller's and the test's references remain");
    }

    #[test]
    fn wrapped_real_communicators_are_known_while_a_handle_wraps_them() {
        let real = 0x7e57_0000usize;
        assert!(!wraps_real(real as ncclComm_t));
        let a = CommHandle::new(0, 1, 0, true, Some(real));
        let p = register(a.clone());
        assert!(wraps_real(real as ncclComm_t));
        assert!(!wraps_real(p), "a handle is not a real communicator");
        // The real NCCL reused the address while the first handle still lives.
        let b = CommHandle::new(0, 1, 0, true, Some(real));
        drop(unregister(p).unwrap());
        drop(a);
        assert!(wraps_real(real as ncclComm_t), "the second handle still wraps it");
        drop(b);
        assert!(!wraps_real(real as ncclComm_t));
    }

    #[test]
    fn counts_say_where_calls_ran() {
        let h = CommHandle::new(0, 1, 0, true, None);
        h.count("AllReduce", Route::Mkernel);
        h.count("AllReduce", Route::Mkernel);
        h.count("Send", Route::Nccl);
        assert_eq!(h.counts_line(), "on mkernel: AllReduce 2; on NCCL: Send 1");
    }

    #[test]
    fn waiting_for_a_pending_side_returns_once_it_settles() {
        let h = CommHandle::new(0, 1, 0, true, None);
        assert!(h.mk_state().is_none());
        let h2 = h.clone();
        let t = std::thread::spawn(move || h2.mk_comm().map(|c| c.is_none()));
        std::thread::sleep(std::time::Duration::from_millis(20));
        h.settle(MkSlot::Failed(NcclError::system("no driver")));
        assert_eq!(t.join().unwrap().err().unwrap().code, ncclSystemError);
    }
}
