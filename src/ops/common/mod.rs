//! What every op shares: the launch path, the fence between fused ops, the node layout and
//! the fused ops' workspace, tile orders, and the GPU model the planners size roles for.

pub mod fused_fence;
pub mod fused_workspace;
pub mod gpu_model;
pub mod launch;
pub mod node_layout;
pub mod schedule;
