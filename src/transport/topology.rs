//! Where each rank sits: which node, its place within the node, and its peer on every
//! other node. Pure functions over the node index of every rank (`comm::node_of_ranks`,
//! learned from the bootstrap's host hashes or `MK_RANKS_PER_NODE`), so the rules are
//! unit-tested without a machine per node.
//!
//! Inter-node traffic pairs GPU i of one node with GPU i of every other node (one
//! "rail" per local rank, as mKernel and NCCL's rings do): ranks with the same local rank
//! talk across nodes, everything else stays on NVLink within the node.

use crate::error::{MkError, Result};

/// One rank's view of the node layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub rank: usize,
    /// This rank's node.
    pub node: usize,
    /// Number of nodes.
    pub node_count: usize,
    /// This rank's index among the ranks of its node, in rank order.
    pub local_rank: usize,
    /// Ranks on this rank's node, in rank order (`node_ranks[local_rank] == rank`).
    pub node_ranks: Vec<usize>,
    /// For every node, the rank there with this rank's local rank (`Some(rank)` for its
    /// own node; `None` where that node has too few ranks to have one).
    pub rail_peers: Vec<Option<usize>>,
    /// Whether every node holds the same number of ranks (hierarchical algorithms need it).
    pub uniform: bool,
}

impl Topology {
    /// Builds `rank`'s view from the node index of every rank. Node indices must be
    /// numbered 0.. without gaps (as `node_of_ranks` numbers them).
    pub fn new(rank: usize, nodes: &[usize]) -> Result<Topology> {
        let node_count = node_count(nodes)?;
        if rank >= nodes.len() {
            return Err(MkError::invalid_argument(format!("rank {rank} is out of range [0, {})", nodes.len())));
        }
        let node = nodes[rank];
        let node_ranks = ranks_on_node(nodes, node);
        let local_rank = local_rank(nodes, rank);
        let rail_peers = (0..node_count).map(|n| rank_with_local_rank(nodes, n, local_rank)).collect();
        Ok(Topology { rank, node, node_count, local_rank, node_ranks, rail_peers, uniform: is_uniform(nodes) })
    }

    /// Ranks on this node.
    pub fn local_size(&self) -> usize {
        self.node_ranks.len()
    }

    /// Whether traffic must leave the node (and so a proxy and a network transport are
    /// needed). A communicator on one node never starts a proxy.
    pub fn spans_nodes(&self) -> bool {
        self.node_count > 1
    }

    /// The ranks this rank exchanges inter-node traffic with: its rail peers on the other
    /// nodes, in node order.
    pub fn inter_node_peers(&self) -> Vec<usize> {
        self.rail_peers.iter().enumerate().filter(|&(n, _)| n != self.node).filter_map(|(_, p)| *p).collect()
    }
}

/// How the shard of rank `s` reaches this rank in a two-level AllGather: NVLink within a
/// node, the network only between GPU i and GPU i of two nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatherRoute {
    /// This rank's own shard.
    Own,
    /// `from` is on this node: the shard comes over NVLink from it.
    NvLink { from: usize },
    /// `from` is this rank's GPU-i peer on another node: the shard comes over the network.
    Network { from: usize },
    /// `from` is on another node with another local rank: it crosses the network to
    /// `relay` (the rank of this node with `from`'s local rank), which forwards it over
    /// NVLink. Each shard crosses the network once per node, never once per rank.
    Relayed { from: usize, relay: usize },
}

/// Where this rank's contribution to the shard owned by rank `o` goes in a two-level
/// ReduceScatter: first over NVLink to `node_reducer` (the rank of this node with `o`'s
/// local rank; this rank itself when they coincide), which sums the node's contributions
/// and, when `o` is on another node, sends that partial sum to `o` over the network
/// (`o` is its GPU-i peer); `o` then sums one partial per node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReduceRoute {
    pub node_reducer: usize,
    /// Whether the node's partial crosses the network (owner on another node).
    pub crosses_network: bool,
}

impl Topology {
    fn require_uniform(&self, what: &str) -> Result<()> {
        if !self.uniform {
            return Err(MkError::invalid_usage(format!(
                "{what} across nodes needs the same number of ranks on every node (set MK_RANKS_PER_NODE or \
                 launch as many ranks on each host)"
            )));
        }
        Ok(())
    }

    /// Route of every rank's shard to this rank (index = source rank) in a two-level
    /// AllGather. `nodes` is the node of every rank (as for `Topology::new`).
    pub fn allgather_routes(&self, nodes: &[usize]) -> Result<Vec<GatherRoute>> {
        self.require_uniform("a hierarchical AllGather")?;
        Ok((0..nodes.len())
            .map(|s| {
                let local = local_rank(nodes, s);
                if s == self.rank {
                    GatherRoute::Own
                } else if nodes[s] == self.node {
                    GatherRoute::NvLink { from: s }
                } else if local == self.local_rank {
                    GatherRoute::Network { from: s }
                } else {
                    let relay = self.node_ranks[local];
                    GatherRoute::Relayed { from: s, relay }
                }
            })
            .collect())
    }

    /// Route of this rank's contribution to every rank's shard (index = owner) in a
    /// two-level ReduceScatter (the first half of a two-level AllReduce).
    pub fn reduce_scatter_routes(&self, nodes: &[usize]) -> Result<Vec<ReduceRoute>> {
        self.require_uniform("a hierarchical ReduceScatter")?;
        Ok((0..nodes.len())
            .map(|o| ReduceRoute {
                node_reducer: self.node_ranks[local_rank(nodes, o)],
                crosses_network: nodes[o] != self.node,
            })
            .collect())
    }
}

/// Number of nodes; an error when the node numbering has gaps (a node index with no rank),
/// which would mean the numbering did not come from `node_of_ranks`.
pub fn node_count(nodes: &[usize]) -> Result<usize> {
    let Some(&max) = nodes.iter().max() else {
        return Err(MkError::invalid_argument("a topology needs at least one rank"));
    };
    let mut seen = vec![false; max + 1];
    for &n in nodes {
        seen[n] = true;
    }
    if let Some(missing) = seen.iter().position(|s| !s) {
        return Err(MkError::internal(format!("node numbering has a gap: no rank on node {missing} of 0..={max}")));
    }
    Ok(max + 1)
}

/// Ranks on `node`, in rank order.
pub fn ranks_on_node(nodes: &[usize], node: usize) -> Vec<usize> {
    nodes.iter().enumerate().filter(|&(_, &n)| n == node).map(|(r, _)| r).collect()
}

/// `rank`'s index among the ranks of its own node.
pub fn local_rank(nodes: &[usize], rank: usize) -> usize {
    nodes[..rank].iter().filter(|&&n| n == nodes[rank]).count()
}

/// The rank with local rank `local_rank` on `node` (GPU i of that node), if it has one.
pub fn rank_with_local_rank(nodes: &[usize], node: usize, local_rank: usize) -> Option<usize> {
    nodes.iter().enumerate().filter(|&(_, &n)| n == node).nth(local_rank).map(|(r, _)| r)
}

/// Whether all nodes hold the same number of ranks.
pub fn is_uniform(nodes: &[usize]) -> bool {
    let Some(&max) = nodes.iter().max() else { return true };
    let mut counts = vec![0usize; max + 1];
    for &n in nodes {
        counts[n] += 1;
    }
    counts.iter().all(|&c| c == counts[0])
}

/// Groups ranks into nodes: by `ranks_per_node` when given, else by host. Returns each
/// rank's node index (nodes numbered in order of their lowest rank).
pub fn node_of_ranks(host_hashes: &[u64], ranks_per_node: Option<u32>) -> Vec<usize> {
    match ranks_per_node {
        Some(rpn) => (0..host_hashes.len()).map(|r| r / rpn.max(1) as usize).collect(),
        None => {
            let mut seen: Vec<u64> = Vec::new();
            host_hashes
                .iter()
                .map(|h| match seen.iter().position(|x| x == h) {
                    Some(i) => i,
                    None => {
                        seen.push(*h);
                        seen.len() - 1
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::mkResult_t;

    #[test]
    fn two_nodes_of_two_by_ranks_per_node() {
        let nodes = node_of_ranks(&[7; 4], Some(2));
        let t = Topology::new(3, &nodes).unwrap();
        assert_eq!((t.node, t.node_count, t.local_rank, t.local_size()), (1, 2, 1, 2));
        assert_eq!(t.node_ranks, vec![2, 3]);
        assert_eq!(t.rail_peers, vec![Some(1), Some(3)]);
        assert_eq!(t.inter_node_peers(), vec![1]);
        assert!(t.uniform && t.spans_nodes());
    }

    #[test]
    fn interleaved_hosts_pair_gpu_i_with_gpu_i() {
        // Hosts A B A B: ranks 0 and 2 on node 0, 1 and 3 on node 1.
        let nodes = node_of_ranks(&[10, 20, 10, 20], None);
        assert_eq!(nodes, vec![0, 1, 0, 1]);
        let t0 = Topology::new(0, &nodes).unwrap();
        let t2 = Topology::new(2, &nodes).unwrap();
        assert_eq!((t0.local_rank, t2.local_rank), (0, 1));
        assert_eq!(t0.inter_node_peers(), vec![1]);
        assert_eq!(t2.inter_node_peers(), vec![3]);
        assert_eq!(Topology::new(3, &nodes).unwrap().rail_peers, vec![Some(2), Some(3)]);
    }

    #[test]
    fn one_node_needs_no_inter_node_traffic() {
        let t = Topology::new(1, &[0, 0, 0]).unwrap();
        assert!(!t.spans_nodes());
        assert!(t.inter_node_peers().is_empty());
        assert_eq!(t.rail_peers, vec![Some(1)]);
    }

    #[test]
    fn uneven_nodes_have_missing_rail_peers() {
        // Node 0 has three ranks, node 1 has one: local rank 2 has no peer on node 1.
        let nodes = [0, 0, 0, 1];
        assert!(!is_uniform(&nodes));
        let t = Topology::new(2, &nodes).unwrap();
        assert_eq!(t.rail_peers, vec![Some(2), None]);
        assert!(t.inter_node_peers().is_empty());
        assert_eq!(Topology::new(3, &nodes).unwrap().inter_node_peers(), vec![0]);
        assert_eq!(node_of_ranks(&[1; 5], Some(2)), vec![0, 0, 1, 1, 2]);
        assert!(!is_uniform(&node_of_ranks(&[1; 5], Some(2))));
    }

    #[test]
    fn three_nodes_every_rail() {
        let nodes = node_of_ranks(&[0; 6], Some(2));
        for r in 0..6 {
            let t = Topology::new(r, &nodes).unwrap();
            assert_eq!(t.node_count, 3);
            assert_eq!(t.node_ranks[t.local_rank], r);
            let peers = t.inter_node_peers();
            assert_eq!(peers.len(), 2);
            for p in peers {
                assert_eq!(p % 2, r % 2, "rank {r} paired with {p} of another local rank");
                assert_ne!(nodes[p], nodes[r]);
            }
        }
    }

    /// Simulates a two-level AllGather from the routes: every rank ends with every shard,
    /// each network transfer is between GPU-i peers, and each shard crosses into a node once.
    #[test]
    fn allgather_routes_deliver_every_shard_once_per_node() {
        for (nranks, rpn) in [(4, 2), (6, 2), (6, 3), (8, 4), (3, 1), (4, 4)] {
            let nodes = node_of_ranks(&vec![0; nranks], Some(rpn));
            let tops: Vec<Topology> = (0..nranks).map(|r| Topology::new(r, &nodes).unwrap()).collect();
            let mut network_arrivals = std::collections::HashSet::new();
            for t in &tops {
                let routes = t.allgather_routes(&nodes).unwrap();
                assert_eq!(routes.len(), nranks);
                for (s, route) in routes.iter().enumerate() {
                    match *route {
                        GatherRoute::Own => assert_eq!(s, t.rank),
                        GatherRoute::NvLink { from } => assert!(from == s && nodes[s] == t.node),
                        GatherRoute::Network { from } => {
                            assert!(from == s && nodes[s] != t.node && local_rank(&nodes, s) == t.local_rank);
                            // The shard's one entry into this node.
                            assert!(network_arrivals.insert((s, t.node)), "shard {s} entered node {} twice", t.node);
                        }
                        GatherRoute::Relayed { from, relay } => {
                            assert!(from == s && nodes[s] != t.node);
                            assert_eq!(nodes[relay], t.node, "the relay is on this node");
                            // The relay itself gets the shard over the network.
                            assert_eq!(
                                tops[relay].allgather_routes(&nodes).unwrap()[s],
                                GatherRoute::Network { from: s }
                            );
                        }
                    }
                }
            }
            let node_count = node_count(&nodes).unwrap();
            assert_eq!(network_arrivals.len(), nranks * (node_count - 1), "{nranks} ranks, {rpn} per node");
        }
    }

    /// Simulates a two-level ReduceScatter: each owner receives exactly one contribution
    /// path from every rank, through the node reducer with the owner's local rank.
    #[test]
    fn reduce_scatter_routes_sum_every_contribution_once() {
        for (nranks, rpn) in [(4, 2), (6, 3), (8, 2), (2, 1)] {
            let nodes = node_of_ranks(&vec![0; nranks], Some(rpn));
            let tops: Vec<Topology> = (0..nranks).map(|r| Topology::new(r, &nodes).unwrap()).collect();
            for o in 0..nranks {
                let mut contributors_per_reducer = std::collections::BTreeMap::<usize, Vec<usize>>::new();
                for t in &tops {
                    let route = t.reduce_scatter_routes(&nodes).unwrap()[o];
                    assert_eq!(nodes[route.node_reducer], t.node, "the first hop stays in the node");
                    assert_eq!(
                        local_rank(&nodes, route.node_reducer),
                        local_rank(&nodes, o),
                        "reducer is GPU-i of the owner"
                    );
                    assert_eq!(route.crosses_network, nodes[o] != t.node);
                    contributors_per_reducer.entry(route.node_reducer).or_default().push(t.rank);
                }
                // One reducer per node, each summing its whole node; the owner's own node
                // reducer is the owner itself.
                assert_eq!(contributors_per_reducer.len(), node_count(&nodes).unwrap());
                for (reducer, contributors) in &contributors_per_reducer {
                    assert_eq!(contributors, &ranks_on_node(&nodes, nodes[*reducer]));
                    if nodes[*reducer] == nodes[o] {
                        assert_eq!(*reducer, o);
                    }
                }
            }
        }
    }

    #[test]
    fn hierarchical_routes_need_uniform_nodes() {
        let t = Topology::new(0, &[0, 0, 1]).unwrap();
        assert_eq!(t.allgather_routes(&[0, 0, 1]).unwrap_err().code, mkResult_t::mkInvalidUsage);
        assert_eq!(t.reduce_scatter_routes(&[0, 0, 1]).unwrap_err().code, mkResult_t::mkInvalidUsage);
    }

    #[test]
    fn bad_inputs_are_errors_not_panics() {
        assert_eq!(Topology::new(0, &[]).unwrap_err().code, mkResult_t::mkInvalidArgument);
        assert_eq!(Topology::new(4, &[0, 0, 1, 1]).unwrap_err().code, mkResult_t::mkInvalidArgument);
        assert_eq!(node_count(&[0, 2]).unwrap_err().code, mkResult_t::mkInternalError);
    }
}
