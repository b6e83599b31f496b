//! The set of live communicator handles and the calls in flight on each.
//!
//! A handle is the address of a small allocation made for it and never freed, so no later
//! communicator gets the same address: a destroyed handle stays recognisable as destroyed,
//! and any other pointer is recognised as foreign. The registry maps addresses to slots and
//! never dereferences the pointer it is given.
//!
//! A call on a communicator holds an `Arc` of its entry and counts itself in flight until it
//! returns. Destroy and abort close the slot (later calls are refused), wait a bounded time
//! for the calls in flight to leave, and drop the registry's `Arc`: the communicator is
//! freed by whoever lets go of it last, never under a caller. A hand-written registry
//! because the rules (ended handles stay known, a bounded drain) are the point of it.

use crate::error::{MkError, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a handle ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    Destroyed,
    Aborted,
}

impl Ending {
    fn describe(self) -> &'static str {
        match self {
            Ending::Destroyed => "was destroyed by mkCommDestroy",
            Ending::Aborted => "was aborted by mkCommAbort",
        }
    }
}

struct Entry<T> {
    value: T,
    in_flight: Mutex<usize>,
    left: Condvar,
}

enum Slot<T> {
    Live(Arc<Entry<T>>),
    Ended(Ending),
}

/// Handles by address: live ones with their value, ended ones with how they ended.
pub struct Registry<T> {
    slots: Mutex<BTreeMap<usize, Slot<T>>>,
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// One call in flight on a live handle; derefs to the handle's value, which stays alive
/// (and counted in flight) until this is dropped.
pub struct Call<T> {
    entry: Arc<Entry<T>>,
}

impl<T> Deref for Call<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.entry.value
    }
}

impl<T> Drop for Call<T> {
    fn drop(&mut self) {
        let mut n = self.entry.in_flight.lock();
        *n -= 1;
        if *n == 0 {
            self.entry.left.notify_all();
        }
    }
}

/// A handle taken out of service by destroy or abort: no new call can reach its value.
/// Dropping it drops the value unless a call still in flight holds it (that call then does).
pub struct Closed<T> {
    entry: Arc<Entry<T>>,
}

impl<T> Closed<T> {
    pub fn value(&self) -> &T {
        &self.entry.value
    }

    /// Waits until no call is in flight on the handle, at most `bound`. Returns how many
    /// calls are still inside when it gives up (0: none).
    pub fn wait_for_calls(&self, bound: Duration) -> usize {
        let deadline = Instant::now() + bound;
        let mut n = self.entry.in_flight.lock();
        while *n > 0 {
            if self.entry.left.wait_until(&mut n, deadline).timed_out() {
                break;
            }
        }
        *n
    }
}

impl<T> Registry<T> {
    pub const fn new() -> Self {
        Registry { slots: Mutex::new(BTreeMap::new()) }
    }

    /// Registers `value` under `handle`, an address never handed out before.
    pub fn insert(&self, handle: usize, value: T) {
        let entry = Arc::new(Entry { value, in_flight: Mutex::new(0), left: Condvar::new() });
        let previous = self.slots.lock().insert(handle, Slot::Live(entry));
        assert!(previous.is_none(), "handle {handle:#x} registered twice");
    }

    fn not_live(handle: usize, slot: Option<&Slot<T>>) -> MkError {
        match slot {
            _ if handle == 0 => MkError::invalid_argument("comm is NULL"),
            Some(Slot::Ended(how)) => MkError::invalid_argument(format!(
                "comm {handle:#x} {}; it cannot be used any more (create a new communicator)",
                how.describe()
            )),
            _ => MkError::invalid_argument(format!(
                "comm {handle:#x} is not a communicator of this library (not made by mkCommInitRank, \
                 mkCommInitRankConfig or mkCommInitAll)"
            )),
        }
    }

    /// Starts a call on `handle`: its value, held until the returned `Call` drops.
    /// NULL, ended and unknown handles are `mkInvalidArgument`.
    pub fn enter(&self, handle: usize) -> Result<Call<T>> {
        let slots = self.slots.lock();
        match slots.get(&handle) {
            Some(Slot::Live(entry)) if handle != 0 => {
                *entry.in_flight.lock() += 1;
                Ok(Call { entry: entry.clone() })
            }
            slot => Err(Self::not_live(handle, slot)),
        }
    }

    /// Ends `handle` (`how` is what later calls are told): from here on every call on it is
    /// refused. Only one closer gets the value; a second destroy or abort is refused too.
    pub fn close(&self, handle: usize, how: Ending) -> Result<Closed<T>> {
        let mut slots = self.slots.lock();
        match slots.get_mut(&handle) {
            Some(slot @ Slot::Live(_)) if handle != 0 => match std::mem::replace(slot, Slot::Ended(how)) {
                Slot::Live(entry) => Ok(Closed { entry }),
                Slot::Ended(_) => unreachable!("matched Live"),
            },
            slot => Err(Self::not_live(handle, slot.as_deref())),
        }
    }

    /// Handles ever registered that are still live.
    pub fn live_count(&self) -> usize {
        self.slots.lock().values().filter(|s| matches!(s, Slot::Live(_))).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Barrier;

    /// A communicator stand-in: an abort flag its "operation" polls (as kernels poll the
    /// host abort word), and a record of when it was freed.
    struct StandIn {
        aborted: AtomicBool,
        freed: Arc<AtomicBool>,
    }

    impl Drop for StandIn {
        fn drop(&mut self) {
            self.freed.store(true, Ordering::SeqCst);
        }
    }

    fn stand_in() -> (StandIn, Arc<AtomicBool>) {
        let freed = Arc::new(AtomicBool::new(false));
        (StandIn { aborted: AtomicBool::new(false), freed: freed.clone() }, freed)
    }

    /// A distinct address per test handle, as the real handles' never-freed allocations give.
    fn fresh_handle() -> usize {
        Box::leak(Box::new(0u8)) as *mut u8 as usize
    }

    #[test]
    fn null_foreign_and_ended_handles_are_refused_by_name() {
        let reg = Registry::new();
        let (v, freed) = stand_in();
        let h = fresh_handle();
        reg.insert(h, v);
        assert!(reg.enter(h).is_ok());
        assert_eq!(reg.enter(0).err().unwrap().message, "comm is NULL");
        let foreign = reg.enter(h + 1).err().unwrap();
        assert_eq!(foreign.code, crate::error::mkResult_t::mkInvalidArgument);
        assert!(foreign.message.contains("is not a communicator of this library"), "{}", foreign.message);
        drop(reg.close(h, Ending::Destroyed).unwrap());
        assert!(freed.load(Ordering::SeqCst), "the last holder frees the value");
        assert!(reg.enter(h).err().unwrap().message.contains("was destroyed by mkCommDestroy"));
        assert!(reg.close(h, Ending::Destroyed).err().unwrap().message.contains("was destroyed"), "a second destroy");
        assert!(reg.close(h + 1, Ending::Aborted).err().unwrap().message.contains("not a communicator"));
        assert_eq!(reg.close(0, Ending::Aborted).err().unwrap().message, "comm is NULL");
        assert_eq!(reg.live_count(), 0);
    }

    #[test]
    fn abort_from_another_thread_waits_for_the_call_inside_and_refuses_later_calls() {
        let reg = Arc::new(Registry::new());
        let (v, freed) = stand_in();
        let h = fresh_handle();
        reg.insert(h, v);
        let inside = Arc::new(Barrier::new(2));
        let caller = {
            let (reg, inside, freed) = (reg.clone(), inside.clone(), freed.clone());
            std::thread::spawn(move || {
                let call = reg.enter(h).unwrap();
                inside.wait();
                // The operation waits until it observes the abort, bounded.
                let start = Instant::now();
                while !call.aborted.load(Ordering::SeqCst) {
                    assert!(start.elapsed() < Duration::from_secs(10), "the abort was never observed");
                    std::thread::sleep(Duration::from_millis(1));
                }
                // Linger: the closer must still wait for this call before freeing.
                std::thread::sleep(Duration::from_millis(50));
                assert!(!freed.load(Ordering::SeqCst), "freed while a call was inside");
            })
        };
        inside.wait();
        let closed = reg.close(h, Ending::Aborted).unwrap();
        assert!(
            reg.enter(h).err().unwrap().message.contains("was aborted by mkCommAbort"),
            "calls after abort are refused"
        );
        // The clock starts before the caller can see the abort: it lingers 50 ms after that,
        // so a wait that returns sooner did not wait for it, however the threads are scheduled.
        let start = Instant::now();
        closed.value().aborted.store(true, Ordering::SeqCst);
        assert_eq!(closed.wait_for_calls(Duration::from_secs(10)), 0);
        assert!(start.elapsed() >= Duration::from_millis(50), "returned before the call left");
        caller.join().unwrap();
        drop(closed);
        assert!(freed.load(Ordering::SeqCst));
    }

    #[test]
    fn a_call_that_outlives_the_bounded_wait_frees_the_value_when_it_leaves() {
        let reg = Registry::new();
        let (v, freed) = stand_in();
        let h = fresh_handle();
        reg.insert(h, v);
        let call = reg.enter(h).unwrap();
        let closed = reg.close(h, Ending::Destroyed).unwrap();
        assert_eq!(closed.wait_for_calls(Duration::from_millis(20)), 1);
        drop(closed);
        assert!(!freed.load(Ordering::SeqCst), "still in use by the call");
        assert!(!call.aborted.load(Ordering::SeqCst), "the value is still readable");
        drop(call);
        assert!(freed.load(Ordering::SeqCst));
    }

    #[test]
    fn concurrent_calls_and_closers_never_see_a_freed_value() {
        let reg = Arc::new(Registry::new());
        let (v, freed) = stand_in();
        let h = fresh_handle();
        reg.insert(h, v);
        let ok_calls = Arc::new(AtomicUsize::new(0));
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let (reg, freed, ok_calls) = (reg.clone(), freed.clone(), ok_calls.clone());
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        match reg.enter(h) {
                            Ok(call) => {
                                assert!(!freed.load(Ordering::SeqCst));
                                let _ = call.aborted.load(Ordering::SeqCst);
                                ok_calls.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => assert!(e.message.contains("was aborted"), "{}", e.message),
                        }
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(2));
        let closers: Vec<_> = (0..2)
            .map(|_| {
                let reg = reg.clone();
                std::thread::spawn(move || match reg.close(h, Ending::Aborted) {
                    Ok(closed) => {
                        closed.value().aborted.store(true, Ordering::SeqCst);
                        assert_eq!(closed.wait_for_calls(Duration::from_secs(10)), 0);
                        1
                    }
                    Err(e) => {
                        assert!(e.message.contains("was aborted"));
                        0
                    }
                })
            })
            .collect();
        let closed_by: usize = closers.into_iter().map(|t| t.join().unwrap()).sum();
        callers.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(closed_by, 1, "exactly one closer takes the value");
        assert!(freed.load(Ordering::SeqCst));
    }
}
