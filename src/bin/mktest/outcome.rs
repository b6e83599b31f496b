//! What a suite reports: how many checks it executed (held against the suite's floor in
//! main.rs), that it started rank processes which each report their own, or that it could
//! not run here (SKIPPED, never a pass). The exit codes say the same to a script.

use std::sync::atomic::{AtomicUsize, Ordering};

pub use crate::ranks::SKIP_EXIT;

pub enum Outcome {
    /// The suite ran in this process; `tally()` holds the checks it executed.
    Ran,
    /// The suite ran in rank processes, each of which held its checks against the floor.
    Spawned { nranks: usize },
    /// The suite could not run here (the reason says why).
    Skipped(String),
}

static CHECKS: AtomicUsize = AtomicUsize::new(0);

/// Counts `n` executed checks (a comparison with a reference, an expected error code).
pub fn count(n: usize) {
    CHECKS.fetch_add(n, Ordering::Relaxed);
}

/// The checks counted so far in this process, and resets the count.
pub fn take_tally() -> usize {
    CHECKS.swap(0, Ordering::Relaxed)
}
