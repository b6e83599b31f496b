//! The Hopper GEMM engine every op plans with ([`engine`]: tiles, clusters, split-K, the
//! kernel of a plan; [`table`]: the tile table; [`smem`]: its ring depth and shared memory),
//! and the mkGemm op on it ([`op`]); the scaled fp8 GEMM ([`scaled`]), a mainloop of its own
//! beside the engine.

pub mod engine;
pub mod op;
pub mod scaled;
pub mod smem;
pub mod table;
