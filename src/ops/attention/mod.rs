//! Ring attention across the ranks: the forward pass and its backward.

pub mod ring_attention;
pub mod ring_attention_backward;

/// Bytes of one Q, K, V (and dO) element in the attention kernels' shared-memory tiles and
/// of the K/V a schedule section keeps in L2. The plans are made before a call's element
/// type is chosen (one plan serves both 16-bit instances, whose layouts are the same), so
/// they size the tiles with this; every attention instance of kernels/instances.txt has
/// elements of this size (the modules' tests check it), and an instance of another width
/// makes those tests fail until its plan takes the element type.
pub const TILE_ELEMENT_BYTES: usize = 2;

#[cfg(test)]
mod tests {
    use super::{ring_attention, ring_attention_backward, TILE_ELEMENT_BYTES};
    use crate::tuning::RingBackwardEngine;
    use crate::types::ELEMENT_TYPES;

    const ENGINES: [RingBackwardEngine; 3] =
        [RingBackwardEngine::TwoPass, RingBackwardEngine::OnePass, RingBackwardEngine::OnePassAtomic];

    #[test]
    fn every_attention_instance_has_tile_sized_elements() {
        let mut instances = 0;
        for t in ELEMENT_TYPES.iter() {
            for head_dim in [64, 128] {
                let forward = ring_attention::kernel_for(t, head_dim, false).is_ok();
                let backward =
                    ENGINES.iter().filter(|&&e| ring_attention_backward::kernel_for(e, t, head_dim).is_ok()).count();
                if forward || backward > 0 {
                    assert_eq!(t.bytes, TILE_ELEMENT_BYTES, "{} has an attention kernel", t.c_name);
                    instances += usize::from(forward) + backward;
                }
            }
        }
        assert!(instances >= 4, "found {instances} attention instances");
    }
}
