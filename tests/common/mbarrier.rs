//! An mbarrier of the kernels modelled on the CPU, for the tests that port a device
//! protocol to host threads (tests/split_k_protocol.rs, tests/tile_ticket_protocol.rs).

use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// An mbarrier: `count` arrivals complete the current phase; a waiter asks for the
/// completion of the phase with a given parity (a fresh barrier's phase 0 is incomplete,
/// so waiting on parity 1 returns at once, as `mbar_wait` documents).
pub struct Mbarrier {
    state: Mutex<(u32, u32)>, // (completed phases, arrivals in the current phase)
    count: u32,
    changed: Condvar,
    /// Named in the failure when a wait hangs.
    what: &'static str,
}

impl Mbarrier {
    pub fn new(count: u32, what: &'static str) -> Mbarrier {
        Mbarrier { state: Mutex::new((0, 0)), count, changed: Condvar::new(), what }
    }

    pub fn arrive(&self) {
        let mut s = self.state.lock().unwrap();
        s.1 += 1;
        if s.1 == self.count {
            s.0 += 1;
            s.1 = 0;
            self.changed.notify_all();
        }
    }

    /// try_wait.parity: returns once the phase of this parity has completed, i.e. the
    /// current (incomplete) phase's parity differs from `parity`; a wait that lasts 20 s
    /// is a hang and fails the test.
    pub fn wait(&self, parity: u32) {
        let mut s = self.state.lock().unwrap();
        while s.0 % 2 == parity {
            let (g, timeout) = self.changed.wait_timeout(s, Duration::from_secs(20)).unwrap();
            assert!(!timeout.timed_out(), "a {} wait hung (parity {parity})", self.what);
            s = g;
        }
    }
}
