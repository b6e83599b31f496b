//! A communicator's asynchronous error: the first failure a kernel or the proxy recorded,
//! which every later op reports instead of running.

use crate::error::{mkResult_t, MkError};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicI32, Ordering};

/// The first error wins: its code is what `mkCommGetAsyncError` returns from then on, and
/// its description (which op, which peer) goes into every refusal, so that the message an
/// application reads after any later call still says what went wrong.
pub struct AsyncError {
    code: AtomicI32,
    description: Mutex<String>,
}

impl Default for AsyncError {
    fn default() -> Self {
        AsyncError { code: AtomicI32::new(mkResult_t::mkSuccess as i32), description: Mutex::new(String::new()) }
    }
}

impl AsyncError {
    /// Records `e` if nothing was recorded before; returns whether it was the first.
    pub fn record(&self, e: &MkError) -> bool {
        // The description is written under its lock before the code is published, so a
        // reader that sees the code finds the description.
        let mut description = self.description.lock();
        let first = self
            .code
            .compare_exchange(mkResult_t::mkSuccess as i32, e.code as i32, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if first {
            *description = e.message.clone();
        }
        first
    }

    pub fn code(&self) -> mkResult_t {
        mkResult_t::from_i32(self.code.load(Ordering::Acquire))
    }

    pub fn is_set(&self) -> bool {
        self.code() != mkResult_t::mkSuccess
    }

    /// The error an op returns instead of running once an error is recorded.
    pub fn refusal(&self) -> Option<MkError> {
        let description = self.description.lock();
        match self.code() {
            mkResult_t::mkSuccess => None,
            code => Some(MkError::new(
                code,
                format!(
                    "the communicator stopped at an earlier asynchronous error: {}; destroy it and create a new one",
                    description.trim_end_matches('.')
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_error_wins_and_every_refusal_carries_its_description() {
        let a = AsyncError::default();
        assert!(!a.is_set());
        assert!(a.refusal().is_none());
        let timeout = MkError::new(
            mkResult_t::mkTimeout,
            "mkAllReduce on rank 0 timed out waiting for rank 1 after MK_TIMEOUT_MS.".to_string(),
        );
        assert!(a.record(&timeout));
        assert!(!a.record(&MkError::remote("a later failure")), "only the first is kept");
        assert_eq!(a.code(), mkResult_t::mkTimeout);
        for _ in 0..2 {
            let r = a.refusal().unwrap();
            assert_eq!(r.code, mkResult_t::mkTimeout);
            assert!(r.message.contains("mkAllReduce on rank 0 timed out waiting for rank 1"), "{}", r.message);
            assert!(r.message.ends_with("; destroy it and create a new one"), "{}", r.message);
            assert!(!r.message.contains("a later failure"));
        }
    }
}
