//! The flag a timed-out wait polled, as the kernel left it in the status block
//! (signals.cuh mk_record_timeout), and its description in the error message: which
//! rank's region, which word by name, the value awaited and the value last read.

use crate::kernel_abi as abi;

/// The first wait of this rank that timed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimedOutWait {
    /// The flag's device address as this rank's kernels see it.
    pub flag: u64,
    pub target: u64,
    pub seen: u64,
}

/// Where a flag address lies: the global rank whose signal region holds it and the word
/// index there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlagPlace {
    pub rank: usize,
    pub word: u32,
}

/// The named words of the signal region (kernel_abi.rs), in increasing order. A word is
/// named after the last entry at or below it, with its offset from there: MOE_RECV + 17 is
/// the receive flag of source-expert pair 17.
const NAMED_WORDS: &[(&str, u32)] = &[
    ("MK_SIG_ABORT", abi::MK_SIG_ABORT),
    ("MK_SIG_ERROR_CLAIM", abi::MK_SIG_ERROR_CLAIM),
    ("MK_SIG_FENCE_SEQ", abi::MK_SIG_FENCE_SEQ),
    ("MK_SIG_FENCE_DONE", abi::MK_SIG_FENCE_DONE),
    ("MK_SIG_FENCE_NET_DONE", abi::MK_SIG_FENCE_NET_DONE),
    ("MK_SIG_SEQ", abi::MK_SIG_SEQ),
    ("MK_SIG_READY", abi::MK_SIG_READY),
    ("MK_SIG_READY2", abi::MK_SIG_READY2),
    ("MK_SIG_FREE", abi::MK_SIG_FREE),
    ("MK_SIG_NET_GRANT", abi::MK_SIG_NET_GRANT),
    ("MK_SIG_NET_READY", abi::MK_SIG_NET_READY),
    ("MK_SIG_NET_READY2", abi::MK_SIG_NET_READY2),
    ("AGG_EPOCH", abi::AGG_EPOCH),
    ("AGG_ARRIVE", abi::AGG_ARRIVE),
    ("AGG_LOCAL", abi::AGG_LOCAL),
    ("AGG_DONE", abi::AGG_DONE),
    ("AGG_NET_DONE", abi::AGG_NET_DONE),
    ("AGG_CHUNK", abi::AGG_CHUNK),
    ("AGG_PUSHED", abi::AGG_PUSHED),
    ("AGG_WORDS_END", abi::AGG_WORDS_END),
    ("GR_EPOCH", abi::GR_EPOCH),
    ("GR_ARRIVE", abi::GR_ARRIVE),
    ("GR_DONE", abi::GR_DONE),
    ("GR_NET_DONE", abi::GR_NET_DONE),
    ("GR_COUNT", abi::GR_COUNT),
    ("GR_TILE", abi::GR_TILE),
    ("MOE_EPOCH", abi::MOE_EPOCH),
    ("MOE_ARRIVE", abi::MOE_ARRIVE),
    ("MOE_PREP", abi::MOE_PREP),
    ("MOE_PREP_ARRIVE", abi::MOE_PREP_ARRIVE),
    ("MOE_PREP_COUNTED", abi::MOE_PREP_COUNTED),
    ("MOE_PREP_SCANNED", abi::MOE_PREP_SCANNED),
    ("MOE_PREP_OFFSETS", abi::MOE_PREP_OFFSETS),
    ("MOE_DONE", abi::MOE_DONE),
    ("MOE_CNT", abi::MOE_CNT),
    ("MOE_GRAB", abi::MOE_GRAB),
    ("MOE_EXIT", abi::MOE_EXIT),
    ("MOE_PULL_GRAB", abi::MOE_PULL_GRAB),
    ("MOE_PULL_EXIT", abi::MOE_PULL_EXIT),
    ("MOE_TILE_NEXT", abi::MOE_TILE_NEXT),
    ("MOE_TILE_EXIT", abi::MOE_TILE_EXIT),
    ("MOE_RECV", abi::MOE_RECV),
    ("MOE_SENT", abi::MOE_SENT),
    ("MOE_TILE", abi::MOE_TILE),
    ("RING_EPOCH", abi::RING_EPOCH),
    ("RING_ARRIVE", abi::RING_ARRIVE),
    ("RING_COPIED", abi::RING_COPIED),
    ("RING_SCHED_NEXT", abi::RING_SCHED_NEXT),
    ("RING_SCHED_DONE", abi::RING_SCHED_DONE),
    ("RING_DONE", abi::RING_DONE),
    ("RING_KV", abi::RING_KV),
    ("RING_BWD_EPOCH", abi::RING_BWD_EPOCH),
    ("RING_BWD_ARRIVE", abi::RING_BWD_ARRIVE),
    ("RING_BWD_COPIED", abi::RING_BWD_COPIED),
    ("RING_BWD_SCHED_NEXT", abi::RING_BWD_SCHED_NEXT),
    ("RING_BWD_SCHED_DONE", abi::RING_BWD_SCHED_DONE),
    ("RING_BWD_ROWS_ARRIVE", abi::RING_BWD_ROWS_ARRIVE),
    ("RING_BWD_ROWS_READY", abi::RING_BWD_ROWS_READY),
    ("RING_BWD_DONE", abi::RING_BWD_DONE),
    ("RING_BWD_KV", abi::RING_BWD_KV),
    ("RING_BWD_CHAIN", abi::RING_BWD_CHAIN),
];

/// A signal word by name: `MOE_PREP_SCANNED`, `MOE_RECV + 17`.
pub fn signal_word_name(word: u32) -> String {
    match NAMED_WORDS.iter().rev().find(|&&(_, start)| start <= word) {
        Some(&(name, start)) if start == word => name.to_string(),
        Some(&(name, start)) => format!("{name} + {}", word - start),
        None => format!("signal word {word}"),
    }
}

impl TimedOutWait {
    /// The clause the timeout's message gains: the flag by place and name, or its raw
    /// address when it lies outside every signal region (an LL line, a data-region word).
    pub fn describe(&self, place: Option<FlagPlace>) -> String {
        let at = match place {
            Some(p) => format!("{} (word {}) of rank {}'s signal region", signal_word_name(p.word), p.word, p.rank),
            None => format!("the word at {:#x}", self.flag),
        };
        format!("the wait polled {at}: it read {}, it waited for at least {}", self.seen, self.target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_words_are_in_increasing_order() {
        for pair in NAMED_WORDS.windows(2) {
            assert!(pair[0].1 < pair[1].1, "{} ({}) before {} ({})", pair[0].0, pair[0].1, pair[1].0, pair[1].1);
        }
    }

    #[test]
    fn words_are_named_by_the_last_name_at_or_below_them() {
        assert_eq!(signal_word_name(abi::MOE_PREP_SCANNED), "MOE_PREP_SCANNED");
        assert_eq!(signal_word_name(abi::MOE_RECV + 17), "MOE_RECV + 17");
        assert_eq!(signal_word_name(abi::MK_SIG_READY + 3), "MK_SIG_READY + 3");
        assert_eq!(signal_word_name(abi::RING_BWD_CHAIN + 5), "RING_BWD_CHAIN + 5");
    }

    #[test]
    fn a_description_names_the_place_or_the_raw_address() {
        let w = TimedOutWait { flag: 0x7f00_0000_1028, target: 42, seen: 41 };
        let placed = w.describe(Some(FlagPlace { rank: 1, word: abi::MOE_PREP_SCANNED }));
        assert_eq!(
            placed,
            format!(
                "the wait polled MOE_PREP_SCANNED (word {}) of rank 1's signal region: it read 41, it waited for at least 42",
                abi::MOE_PREP_SCANNED
            )
        );
        assert!(w.describe(None).starts_with("the wait polled the word at 0x7f0000001028: it read 41"));
    }
}
