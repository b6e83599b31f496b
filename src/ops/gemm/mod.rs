//! The Hopper GEMM engine every op plans with ([`engine`]: tiles, clusters, split-K, the
//! kernel of a plan; [`table`]: the tile table; [`smem`]: its ring depth and shared memory),
//! and the mkGemm op on it ([`op`]).

pub mod engine;
pub mod op;
pub mod smem;
pub mod table;
