//! What a suite reports: how many checks it executed (held against the suite's floor in
//! main.rs), that it started rank processes which each report their own, that it ran its
//! ranks as threads (the fewest checks of any rank, held against the floor), or that it
//! could not run here (SKIPPED, never a pass). The exit codes say the same to a script.

use std::cell::Cell;

pub use crate::ranks::SKIP_EXIT;

pub enum Outcome {
    /// The suite ran on this thread; `take_tally()` holds the checks it executed.
    Ran,
    /// The suite ran in rank processes, each of which held its checks against the floor.
    Spawned { nranks: usize },
    /// The suite ran its ranks as threads of this process (MK_TEST_THREADS=1); the rank
    /// that executed the fewest checks executed `fewest_checks`.
    Threads { nranks: usize, fewest_checks: usize },
    /// The suite could not run here (the reason says why).
    Skipped(String),
}

thread_local! {
    /// Per thread: a rank that runs as a thread counts its own checks.
    static CHECKS: Cell<usize> = const { Cell::new(0) };
}

/// Counts `n` executed checks (a comparison with a reference, an expected error code).
pub fn count(n: usize) {
    CHECKS.with(|c| c.set(c.get() + n));
}

/// The checks counted so far on this thread, and resets the count.
pub fn take_tally() -> usize {
    CHECKS.with(|c| c.replace(0))
}
