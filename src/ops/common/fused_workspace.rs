//! The workspace every fused op runs on, one node or several.

use super::node_layout::{node_layout, NodeLayout};
use crate::comm::workspace::SymmetricWorkspace;
use crate::comm::Comm;
use crate::error::{MkError, Result};
use crate::kernel_abi::ProxyRingView;

/// The workspace a dense fused op runs on: on one node the communicator's (refused with
/// mkInvalidUsage when it has no data plane); across nodes this node's (its view indexed
/// by local rank), with the rank table and this rank's proxy ring.
pub fn fused_op_workspace<'a>(
    comm: &'a Comm,
    op: &str,
) -> Result<(&'a SymmetricWorkspace, Option<(NodeLayout, ProxyRingView)>)> {
    if !comm.topology.spans_nodes() {
        return Ok((comm.one_node_workspace(op)?, None));
    }
    let ws = comm.workspace.as_ref().ok_or_else(|| {
        MkError::invalid_usage(
            comm.data_plane_missing.clone().unwrap_or_else(|| "this communicator has no data plane".into()),
        )
    })?;
    let ring = comm.proxy_ring.ok_or_else(|| MkError::internal("a communicator across nodes without a proxy ring"))?;
    Ok((ws, Some((node_layout(&comm.topology, &comm.nodes, op)?, ring))))
}
