//! Bringing up one rank's inter-node path: the transport `MK_NET` chose, connected to the
//! rank's GPU i ↔ GPU i peers, a proxy ring, and the proxy thread draining it. What
//! `Comm::init` will call once kernels post commands; a communicator on one node gets
//! `None` and never starts a thread or touches a NIC.

use super::proxy::{Proxy, ProxyOptions, ProxyRing};
use super::socket::SocketTransport;
use super::{connect_through_bootstrap, NetKind, Transport, TransportAuth, Window};
use crate::bootstrap::Bootstrap;
use crate::error::{MkError, Result};
use crate::mk_info;
use crate::transport::topology::Topology;
use std::sync::Arc;
use std::time::Duration;

/// Everything `start_inter_node` needs from the communicator.
pub struct InterNodeSetup<'a> {
    pub bootstrap: &'a Bootstrap,
    pub topology: &'a Topology,
    pub auth: TransportAuth,
    pub net: NetKind,
    /// The memory peers put into and this rank's puts read from.
    pub window: Window,
    /// MK_TIMEOUT_MS: bounds connecting, every transfer, every producer wait.
    pub timeout: Duration,
    /// Makes the ring kernels will post to (`|| ProxyRing::on_device(1024, timeout)` for a
    /// GPU's producers, `ProxyRing::in_host_memory` for host threads). Called only when the
    /// communicator spans nodes: one node allocates nothing.
    pub make_ring: Box<dyn FnOnce() -> Result<ProxyRing> + 'a>,
    /// The communicator's context (a `CUcontext`), needed when the window is device memory:
    /// the socket transport stages through it. Call with this context current (RDMA's
    /// dmabuf registration uses the current context).
    pub cuda_context: Option<usize>,
    /// CPUs for the proxy thread (`proxy::cpus_near_cuda_device(device)`), or None.
    pub proxy_cpus: Option<Vec<usize>>,
}

/// A rank's running inter-node path. Send + Sync, so a communicator can own it.
pub struct InterNode {
    pub net: NetKind,
    pub ring: Arc<ProxyRing>,
    pub proxy: Proxy,
    /// The ranks this rank's kernels may post puts to.
    pub peers: Vec<usize>,
}

/// Collective over the communicator when it spans nodes (every rank must call it; they
/// all agree on the topology, so either all or none take part); `Ok(None)` on one node.
///
/// # Safety
/// `setup.window` must stay valid until the returned proxy is stopped or dropped (the
/// transport reads and writes it from its own threads, or the NIC does).
pub unsafe fn start_inter_node(setup: InterNodeSetup<'_>) -> Result<Option<InterNode>> {
    let topology = setup.topology;
    if !topology.spans_nodes() {
        return Ok(None);
    }
    let rank = topology.rank;
    let nranks = setup.bootstrap.nranks();
    let mut transport: Box<dyn Transport> = match setup.net {
        NetKind::Socket => {
            let mut socket = SocketTransport::new(rank, nranks, setup.auth, setup.timeout)?;
            if let Some(context) = setup.cuda_context {
                socket.set_cuda_context(context as cudarc::driver::sys::CUcontext);
            }
            Box::new(socket)
        }
        NetKind::Ib => {
            let mut rdma = super::rdma::RdmaTransport::open(rank, nranks)?;
            if let Some(context) = setup.cuda_context {
                rdma.set_cuda_context(context);
            }
            Box::new(rdma)
        }
    };
    // SAFETY: forwarded from this function's contract.
    unsafe { transport.register(setup.window)? };
    let peers = topology.inter_node_peers();
    connect_through_bootstrap(transport.as_mut(), setup.bootstrap, &peers)
        .map_err(|e| e.context(format!("connecting the {} transport", transport.name())))?;
    let ring = Arc::new((setup.make_ring)()?);
    let mut options = ProxyOptions::new(rank, setup.timeout);
    options.cpus = setup.proxy_cpus;
    let proxy = Proxy::start(Arc::clone(&ring), transport, options)?;
    mk_info!(
        Some(rank),
        "inter-node path up over {:?}: peers {peers:?}, {}-slot proxy ring",
        setup.net,
        ring.capacity()
    );
    if topology.rail_peers.iter().any(Option::is_none) {
        // Not an error here: the ops that need a peer on every node reject the layout.
        crate::log::warn(
            Some(rank),
            format_args!("rank {rank} has no GPU-i peer on some node (nodes of unequal size)"),
        );
    }
    Ok(Some(InterNode { net: setup.net, ring, proxy, peers }))
}

impl InterNode {
    /// The proxy's first failure, for `Comm::record_async_error` (→ mkCommGetAsyncError).
    pub fn error(&self) -> Option<MkError> {
        self.proxy.error()
    }
}

const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<InterNode>();
};
