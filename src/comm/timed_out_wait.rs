//! The flag a timed-out wait polled, as the kernel left it in the status block
//! (signals.cuh mk_record_timeout), and its description in the error message: which
//! rank's region, which word by name, the value awaited and the value last read; and, for
//! an op that keeps a progress word, where the awaited peer's op stood.

use crate::kernel_abi as abi;

/// The first wait of this rank that timed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimedOutWait {
    /// The flag's device address as this rank's kernels see it.
    pub flag: u64,
    pub target: u64,
    pub seen: u64,
    /// The awaited peer's progress word and its value when the wait gave up (None: the op
    /// keeps none, or the wait was for this rank's own flag).
    pub progress: Option<PeerProgress>,
}

/// A peer's progress word as a timed-out wait read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerProgress {
    /// The word's device address as this rank's kernels see it.
    pub word: u64,
    pub value: u64,
}

/// The MoE dispatch's progress steps (kernel_abi MOE_STEP_*), by what the prep had done.
fn moe_step_name(step: u64) -> Option<&'static str> {
    Some(match step as u32 {
        abi::MOE_STEP_BEGUN => "begun",
        abi::MOE_STEP_COUNTED => "its tokens counted",
        abi::MOE_STEP_SCANNED => "its counts scanned",
        abi::MOE_STEP_PEERS_DONE => "every peer done with its previous MoE kernel",
        abi::MOE_STEP_COUNTS_SENT => "its counts sent",
        abi::MOE_STEP_COUNTS_IN => "every rank's counts in",
        abi::MOE_STEP_LAYOUT => "its layout complete",
        _ => return None,
    })
}

/// A MOE_PROGRESS word's value: the epoch and step of that rank's latest dispatch prep
/// (an epoch below the one a wait awaited: that dispatch had not begun its prep).
pub fn describe_moe_progress(rank: usize, value: u64) -> String {
    if value == 0 {
        return format!("rank {rank} had begun no MoE dispatch on this communicator");
    }
    let (epoch, step) = (value >> 4, value & 15);
    let step_name = moe_step_name(step).map_or_else(|| format!("step {step}"), str::to_string);
    format!("rank {rank}'s latest MoE dispatch prep: epoch {epoch}, {step_name}")
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
    ("MOE_PROGRESS", abi::MOE_PROGRESS),
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
    /// `place`: where the flag lies; `progress_place`: where the progress word lies.
    pub fn describe(&self, place: Option<FlagPlace>, progress_place: Option<FlagPlace>) -> String {
        let at = match place {
            Some(p) => format!("{} (word {}) of rank {}'s signal region", signal_word_name(p.word), p.word, p.rank),
            None => format!("the word at {:#x}", self.flag),
        };
        let polled = format!("the wait polled {at}: it read {}, it waited for at least {}", self.seen, self.target);
        match (self.progress, progress_place) {
            (Some(p), Some(pp)) if pp.word == abi::MOE_PROGRESS => {
                format!("{polled}; {}", describe_moe_progress(pp.rank, p.value))
            }
            _ => polled,
        }
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
        let w = TimedOutWait { flag: 0x7f00_0000_1028, target: 42, seen: 41, progress: None };
        let placed = w.describe(Some(FlagPlace { rank: 1, word: abi::MOE_PREP_SCANNED }), None);
        assert_eq!(
            placed,
            format!(
                "the wait polled MOE_PREP_SCANNED (word {}) of rank 1's signal region: it read 41, it waited for at least 42",
                abi::MOE_PREP_SCANNED
            )
        );
        assert!(w.describe(None, None).starts_with("the wait polled the word at 0x7f0000001028: it read 41"));
    }

    #[test]
    fn a_peers_moe_progress_says_how_far_its_dispatch_got() {
        let progress = PeerProgress { word: 0x7f00_0000_2038, value: 83 * 16 + u64::from(abi::MOE_STEP_SCANNED) };
        let w = TimedOutWait { flag: 0x7f00_0000_1080, target: 83, seen: 81, progress: Some(progress) };
        let text = w.describe(
            Some(FlagPlace { rank: 1, word: abi::MOE_CNT }),
            Some(FlagPlace { rank: 0, word: abi::MOE_PROGRESS }),
        );
        assert!(
            text.ends_with(": it read 81, it waited for at least 83; rank 0's latest MoE dispatch prep: epoch 83, its counts scanned"),
            "{text}"
        );
        // A dispatch that had not begun shows the previous one's epoch.
        let before = PeerProgress { value: 81 * 16 + u64::from(abi::MOE_STEP_LAYOUT), ..progress };
        let w = TimedOutWait { progress: Some(before), ..w };
        let text = w.describe(None, Some(FlagPlace { rank: 0, word: abi::MOE_PROGRESS }));
        assert!(text.ends_with("rank 0's latest MoE dispatch prep: epoch 81, its layout complete"), "{text}");
        assert_eq!(describe_moe_progress(3, 0), "rank 3 had begun no MoE dispatch on this communicator");
        assert_eq!(describe_moe_progress(3, 5 * 16 + 9), "rank 3's latest MoE dispatch prep: epoch 5, step 9");
        // Only a MOE_PROGRESS word is described; another op's wait keeps its plain clause.
        let other = w.describe(None, Some(FlagPlace { rank: 0, word: abi::MOE_PREP }));
        assert!(other.ends_with("it waited for at least 83"), "{other}");
    }
}
