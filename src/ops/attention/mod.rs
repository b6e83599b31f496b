//! Ring attention across the ranks: the forward pass and its backward.

pub mod ring_attention;
pub mod ring_attention_backward;
