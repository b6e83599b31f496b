//! Which rank is where across nodes, as the kernels' rank table holds it: every op that runs
//! across nodes (the hierarchical collectives, the fused ops, the fence) launches with it.

use crate::error::{MkError, Result};
use crate::kernel_abi::{MK_MAX_NODES, MK_MAX_NODE_RANKS, MK_MAX_PEERS};
use crate::transport::topology::{rank_with_local_rank, Topology};

/// Who is where, as the kernel's rank table holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeLayout {
    pub nodes: usize,
    pub local_size: usize,
    pub node: usize,
    pub local_rank: usize,
    /// rank_of[m * MK_MAX_PEERS + l]: global rank of local rank l on node m (-1: none).
    pub rank_of: [i32; MK_MAX_NODE_RANKS],
}

/// The rank table of a layout: equal-sized nodes (the routes need them), at most
/// MK_MAX_NODES nodes and MK_MAX_PEERS ranks per node.
pub fn node_layout(topology: &Topology, nodes: &[usize], what: &str) -> Result<NodeLayout> {
    // The routes are defined only for equal-sized nodes: refuse others with their message.
    topology.allgather_routes(nodes)?;
    if topology.node_count > MK_MAX_NODES {
        return Err(MkError::invalid_usage(format!(
            "{what} across {} nodes: at most {MK_MAX_NODES} nodes are supported",
            topology.node_count
        )));
    }
    if topology.local_size() > MK_MAX_PEERS {
        return Err(MkError::invalid_usage(format!(
            "{what}: {} ranks per node, at most {MK_MAX_PEERS} are supported",
            topology.local_size()
        )));
    }
    let mut rank_of = [-1i32; MK_MAX_NODE_RANKS];
    for m in 0..topology.node_count {
        for l in 0..topology.local_size() {
            let r = rank_with_local_rank(nodes, m, l)
                .ok_or_else(|| MkError::internal(format!("node {m} has no local rank {l}")))?;
            rank_of[m * MK_MAX_PEERS + l] = r as i32;
        }
    }
    Ok(NodeLayout {
        nodes: topology.node_count,
        local_size: topology.local_size(),
        node: topology.node,
        local_rank: topology.local_rank,
        rank_of,
    })
}
