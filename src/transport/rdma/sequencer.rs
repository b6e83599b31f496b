//! The receiving side of the sequenced (SRD) protocol: messages from one peer arrive in any
//! order, each numbered by the sender; a signal may be written only once every message
//! numbered before it has arrived (its data, and the data of every earlier put to this
//! rank), and signals are written in the order they were sent.

use crate::error::{MkError, Result};
use std::collections::HashMap;

/// Messages further ahead of the oldest missing one than this are a protocol error (a
/// sender keeps at most its send queue's depth in flight, far below this).
pub const SEQUENCE_WINDOW: u32 = 1 << 30;

/// Per-peer reassembly of the message order.
#[derive(Debug, Default)]
pub struct SignalSequencer {
    /// Number of the oldest message not yet arrived.
    next: u32,
    /// Arrived messages numbered `next` or later, with the signal each carries.
    arrived: HashMap<u32, Option<(u32, u64)>>,
}

impl SignalSequencer {
    pub fn new() -> SignalSequencer {
        SignalSequencer::default()
    }

    /// Records message `seq` (carrying `signal` = (signal id, value) or none) and appends
    /// to `ready` the signals that may now be written, in sending order.
    pub fn arrive(
        &mut self,
        peer: usize,
        seq: u32,
        signal: Option<(u32, u64)>,
        ready: &mut Vec<(u32, u64)>,
    ) -> Result<()> {
        if seq.wrapping_sub(self.next) >= SEQUENCE_WINDOW || self.arrived.contains_key(&seq) {
            return Err(MkError::remote(format!(
                "rank {peer} sent message {seq} twice or out of its window (expecting {} next): the RDMA \
                 sequence is corrupt",
                self.next
            )));
        }
        self.arrived.insert(seq, signal);
        while let Some(signal) = self.arrived.remove(&self.next) {
            ready.extend(signal);
            self.next = self.next.wrapping_add(1);
        }
        Ok(())
    }

    /// Messages that arrived ahead of a missing one.
    pub fn waiting(&self) -> usize {
        self.arrived.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic generator (splitmix64) for the delivery orders; the simulated
    /// fabric's own generator lives with the simulator, outside the library.
    struct Rng(u64);

    impl Rng {
        fn new(seed: u64) -> Rng {
            Rng(seed)
        }

        /// Uniform in `0..n` (n > 0).
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) % n
        }

        fn shuffle<T>(&mut self, items: &mut [T]) {
            for i in (1..items.len()).rev() {
                items.swap(i, self.below(i as u64 + 1) as usize);
            }
        }
    }

    #[test]
    fn signals_wait_for_every_earlier_message_and_keep_their_order() {
        let mut rng = Rng::new(7);
        for round in 0..50 {
            // Messages 0..n: a signal every few, the rest data; delivered in random order.
            let n = 5 + rng.below(60) as u32;
            let signal_of = |s: u32| (s % 4 == 3).then_some((s % 5, s as u64 * 10 + 1));
            let mut order: Vec<u32> = (0..n).collect();
            rng.shuffle(&mut order);
            let mut seq = SignalSequencer::new();
            let mut arrived = vec![false; n as usize];
            let mut written = Vec::new();
            for &s in &order {
                let before = written.len();
                seq.arrive(1, s, signal_of(s), &mut written).unwrap();
                arrived[s as usize] = true;
                for &(_, value) in &written[before..] {
                    let sent_as = ((value - 1) / 10) as usize;
                    assert!(arrived[..sent_as].iter().all(|&a| a), "round {round}: signal {sent_as} before its data");
                }
            }
            let expected: Vec<_> = (0..n).filter_map(signal_of).collect();
            assert_eq!(written, expected, "round {round}: every signal once, in sending order");
            assert_eq!(seq.waiting(), 0);
        }
    }

    #[test]
    fn numbers_wrap_and_duplicates_are_errors() {
        let mut seq = SignalSequencer { next: u32::MAX - 1, arrived: HashMap::new() };
        let mut out = Vec::new();
        seq.arrive(2, 0, Some((1, 9)), &mut out).unwrap();
        seq.arrive(2, u32::MAX, None, &mut out).unwrap();
        assert!(out.is_empty());
        seq.arrive(2, u32::MAX - 1, None, &mut out).unwrap();
        assert_eq!(out, vec![(1, 9)]);
        let e = seq.arrive(2, 0, None, &mut out).unwrap_err();
        assert_eq!(e.code, crate::error::mkResult_t::mkRemoteError);
        assert!(seq.arrive(2, 5, None, &mut out).is_ok());
        assert!(seq.arrive(2, 5, None, &mut out).is_err(), "a duplicate ahead of the window start");
    }
}
