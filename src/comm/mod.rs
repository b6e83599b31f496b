//! The communicator: rank, size, device context, bootstrap, configuration, and the error
//! state (`mkGetLastError`, `mkCommGetAsyncError`, abort).

pub mod agreement;
pub mod async_error;
pub mod error_word;
pub mod fence_state;
pub mod timed_out_wait;
pub mod workspace;

use crate::bootstrap::{Bootstrap, UniqueId};
use crate::cuda::pointer::CheckedPointers;
use crate::cuda::PrimaryContext;
use crate::error::{mkResult_t, MkError, Result};
use crate::kernel_abi::ProxyRingView;
use crate::mk_info;
use crate::transport::inter_node::{start_inter_node, InterNode, InterNodeSetup};
use crate::transport::proxy::{cpus_near_cuda_device, ProxyRing};
use crate::transport::topology::{node_of_ranks, Topology};
use crate::transport::{select_net_from_env, MemoryKind, MemoryRegion, TransportAuth, Window};
use parking_lot::Mutex;
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Slots of a communicator's proxy ring: commands in flight from all its CTAs (a
/// hierarchical collective posts at most 3 per step per CTA and peer node).
pub const PROXY_RING_SLOTS: u32 = 1024;

/// Settings resolved from `mkConfig_t`, then the environment, then defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommConfig {
    /// Bound on every in-kernel wait for a peer.
    pub timeout: Duration,
    /// Bound on each bootstrap step.
    pub bootstrap_timeout: Duration,
    /// CTAs for communication roles in fused kernels (None: planned per op).
    pub comm_ctas: Option<u32>,
    /// Cap on any kernel's grid (None: every SM). Needed when ranks share a GPU.
    pub max_ctas: Option<u32>,
    /// Symmetric workspace bytes per rank allocated at init.
    pub workspace_bytes: u64,
    /// Ranks per node (None: grouped by host).
    pub ranks_per_node: Option<u32>,
    /// Internal tuning (src/tuning.rs), the process's.
    pub tuning: crate::tuning::Tuning,
}

impl CommConfig {
    pub fn from_env() -> Self {
        CommConfig {
            timeout: crate::env::timeout(),
            bootstrap_timeout: crate::env::bootstrap_timeout(),
            comm_ctas: crate::env::comm_sms().map(|v| v as u32),
            max_ctas: crate::env::max_ctas().map(|v| v as u32),
            workspace_bytes: crate::env::workspace_bytes(),
            ranks_per_node: crate::env::ranks_per_node().map(|v| v as u32),
            tuning: crate::tuning::Tuning::process(),
        }
    }
}

pub struct Comm {
    /// The inter-node path (proxy thread, transport, ring) when the ranks span nodes.
    /// Declared first: stopped before the workspace its transport writes into goes away.
    /// `abort` takes it out (and aborts the proxy) but keeps its ring in `retired_ring`.
    pub inter_node: Mutex<Option<InterNode>>,
    /// The NVLink data plane among the ranks of this rank's node (all ranks on one node),
    /// indexed by local rank. None when a node holds more than MK_MAX_PEERS ranks;
    /// `data_plane_missing` then says why.
    pub workspace: Option<workspace::SymmetricWorkspace>,
    /// The ring of an aborted inter-node path: kernels may still be leaving it when
    /// mkCommAbort returns, so it is freed after the workspace (whose drop synchronises
    /// the context after an abort).
    retired_ring: Mutex<Option<Arc<ProxyRing>>>,
    pub data_plane_missing: Option<String>,
    pub rank: usize,
    pub nranks: usize,
    /// A number no other communicator of this process has, ever: it keys the host-side
    /// memos of work that depends only on a call's arguments and its communicator (whose
    /// rank, workspace, device and settings never change while it lives).
    pub instance: u64,
    pub context: PrimaryContext,
    /// The buffer addresses the driver has called device memory of this communicator's
    /// device: each is asked about once (`check_buffers`).
    checked_pointers: CheckedPointers,
    pub bootstrap: Bootstrap,
    pub config: CommConfig,
    /// Node index of every rank.
    pub nodes: Vec<usize>,
    /// This rank's place in the node layout.
    pub topology: Topology,
    /// What kernels get to post to the proxy (None on one node).
    pub proxy_ring: Option<ProxyRingView>,
    last_error: Mutex<CString>,
    /// What the host knows of the fused ops launched, for their fences (ops::common::fused_fence).
    pub fused_fence: Mutex<fence_state::FenceState>,
    async_error: async_error::AsyncError,
    aborted: AtomicBool,
}

/// The next communicator's `instance`.
static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

/// Why a communicator has no NVLink data plane, if it has none: a node holds more ranks
/// than the view maps. The same answer on every rank (the creation is collective).
pub fn data_plane_missing(nodes: &[usize]) -> Option<String> {
    let biggest = (0..=nodes.iter().copied().max().unwrap_or(0))
        .map(|n| nodes.iter().filter(|&&m| m == n).count())
        .max()
        .unwrap_or(0);
    (biggest > crate::kernel_abi::MK_MAX_PEERS).then(|| {
        format!("{biggest} ranks on one node; the NVLink data plane maps at most {}", crate::kernel_abi::MK_MAX_PEERS)
    })
}

impl Comm {
    /// Joins the communicator `id` as `rank` of `nranks` on `device` (the caller's current
    /// device when None).
    ///
    /// On several nodes (by host, or `MK_RANKS_PER_NODE`), each node gets its own symmetric
    /// workspace among its ranks, and every rank starts its inter-node path
    /// (`transport::inter_node::start_inter_node`: the transport `MK_NET` picks, connected to
    /// its GPU-i peers, with this rank's workspace registered as its window, and a proxy
    /// thread draining a device-fed ring).
    pub fn init(id: &UniqueId, nranks: i32, rank: i32, device: Option<i32>, config: CommConfig) -> Result<Comm> {
        if nranks <= 0 {
            return Err(MkError::invalid_argument(format!("nranks must be positive, got {nranks}")));
        }
        if nranks as usize > crate::bootstrap::MAX_RANKS {
            return Err(MkError::invalid_argument(format!(
                "nranks = {nranks} exceeds the {} ranks a communicator may have",
                crate::bootstrap::MAX_RANKS
            )));
        }
        if rank < 0 || rank >= nranks {
            return Err(MkError::invalid_argument(format!("rank {rank} is out of range [0, {nranks})")));
        }
        let device = match device {
            Some(d) => d,
            None => crate::cuda::current_device()?,
        };
        let context = PrimaryContext::retain(device)?;
        crate::cuda::platform::check_device(device)?;
        let bootstrap = Bootstrap::join(id, rank as usize, nranks as usize, config.bootstrap_timeout)?;
        let config = agreement::agree(&bootstrap, &config)?;
        let nodes = node_of_ranks(bootstrap.host_hashes(), config.ranks_per_node);
        let topology = Topology::new(rank as usize, &nodes)?;
        let data_plane_missing = data_plane_missing(&nodes);
        let workspace = if data_plane_missing.is_some() {
            None
        } else {
            let _g = context.enter()?;
            Some(workspace::SymmetricWorkspace::create(
                &bootstrap,
                rank as usize,
                nranks as usize,
                &topology.node_ranks,
                &context,
                &config,
            )?)
        };
        let inter_node = match &workspace {
            Some(ws) if topology.spans_nodes() => {
                let _g = context.enter()?;
                let local = topology.local_rank;
                let window = Window {
                    data: MemoryRegion {
                        base: ws.view.data[local],
                        bytes: ws.view.data_bytes + ws.view.op_bytes,
                        kind: MemoryKind::Device,
                    },
                    signals: MemoryRegion {
                        base: ws.view.signals[local],
                        bytes: workspace::SIGNAL_BYTES as u64,
                        kind: MemoryKind::Device,
                    },
                };
                let timeout = config.timeout;
                let setup = InterNodeSetup {
                    bootstrap: &bootstrap,
                    topology: &topology,
                    auth: TransportAuth::from_unique_id(id),
                    net: select_net_from_env()?,
                    window,
                    timeout,
                    make_ring: Box::new(move || ProxyRing::on_device(PROXY_RING_SLOTS, timeout)),
                    cuda_context: Some(context.ctx as usize),
                    proxy_cpus: cpus_near_cuda_device(device),
                };
                // SAFETY: the window is this rank's workspace allocation, which the Comm
                // keeps until after the proxy stops (field order; `abort` stops it first).
                let inter =
                    unsafe { start_inter_node(setup) }.map_err(|e| e.context("starting the inter-node path"))?;
                // Best effort (a failure here only brings back the lazy first load).
                if let Err(e) = crate::cuda::preload_across_nodes() {
                    mk_info!(Some(rank as usize), "kernels not preloaded: {e}");
                }
                inter
            }
            _ => None,
        };
        let proxy_ring = inter_node.as_ref().map(|i| i.ring.view());
        mk_info!(
            Some(rank as usize),
            "communicator ready: {nranks} ranks, device {device}, {} node(s)",
            topology.node_count
        );
        Ok(Comm {
            inter_node: Mutex::new(inter_node),
            workspace,
            retired_ring: Mutex::new(None),
            data_plane_missing,
            rank: rank as usize,
            nranks: nranks as usize,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            checked_pointers: CheckedPointers::new(device),
            context,
            bootstrap,
            config,
            nodes,
            topology,
            proxy_ring,
            last_error: Mutex::new(CString::default()),
            fused_fence: Mutex::new(Default::default()),
            async_error: Default::default(),
            aborted: AtomicBool::new(false),
        })
    }

    /// The workspace for an op that runs within one node only (the fused ops, the flat
    /// collectives): refused with `mkInvalidUsage` when the communicator spans nodes, or
    /// has no data plane.
    pub fn one_node_workspace(&self, op: &str) -> Result<&workspace::SymmetricWorkspace> {
        if self.topology.spans_nodes() {
            return Err(MkError::invalid_usage(format!(
                "{op} does not run across nodes yet (this communicator spans {} nodes); mkAllGather, \
                 mkReduceScatter, mkAllReduce, mkAllGatherGemm, mkGemmReduceScatter and mkGemmAllReduce do",
                self.topology.node_count
            )));
        }
        self.workspace.as_ref().ok_or_else(|| {
            MkError::invalid_usage(
                self.data_plane_missing.clone().unwrap_or_else(|| "this communicator has no data plane".into()),
            )
        })
    }

    /// Checks that each `(address, name)` of `buffers` is device memory of this
    /// communicator's device (or managed memory), asking the driver only about addresses
    /// it has not approved for this communicator before (`cuda::pointer::CheckedPointers`);
    /// else mkInvalidArgument naming the first buffer that is not.
    pub fn check_buffers(&self, buffers: &[(u64, &str)]) -> Result<()> {
        self.checked_pointers.check(buffers)
    }

    /// Replaces the communicator's message (a call on it failed). The previous message's
    /// storage is freed: `mkGetLastError(comm)` promises it only until this happens.
    pub fn set_last_error(&self, message: &str) {
        *self.last_error.lock() = crate::error::c_message(message);
    }

    /// Pointer to the last error message; valid until the next error on this comm or its
    /// release.
    pub fn last_error_ptr(&self) -> *const std::os::raw::c_char {
        self.last_error.lock().as_ptr()
    }

    /// Records an asynchronous error for `mkCommGetAsyncError`. The first one wins, and only
    /// it becomes the communicator's message (a later one would free the string a caller
    /// may be reading).
    pub fn record_async_error(&self, e: &MkError) {
        if self.async_error.record(e) {
            self.set_last_error(&e.message);
        }
    }

    pub fn async_error(&self) -> mkResult_t {
        if !self.async_error.is_set() {
            // A kernel of this rank may have recorded a timeout or a peer's failure; the
            // kernel's word says more (which op, which peer), so it goes first.
            if let Some(ws) = self.workspace.as_ref().filter(|w| w.error_word() != 0) {
                let mut e = crate::comm::error_word::ErrorWord(ws.error_word()).to_error(self.rank);
                if e.code == mkResult_t::mkTimeout {
                    if let Some(wait) = ws.timed_out_wait() {
                        let progress_place = wait.progress.and_then(|p| ws.place_of(p.word));
                        e.message =
                            format!("{} ({})", e.message, wait.describe(ws.place_of(wait.flag), progress_place));
                    }
                }
                self.record_async_error(&e);
            } else if let Some(e) = self.inter_node.lock().as_ref().and_then(InterNode::error) {
                // The proxy failed (a peer's connection lost, a transfer timed out).
                self.record_async_error(&e.context("the inter-node proxy failed"));
            }
        }
        self.async_error.code()
    }

    /// Marks the communicator aborted and unblocks any host-side wait: this rank's kernels
    /// stop (host abort word), the proxy stops at once and cuts its connections (its ring's
    /// error word tells device producers), and the bootstrap's sockets are shut.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        if let Some(ws) = &self.workspace {
            ws.raise_host_abort();
        }
        if let Some(InterNode { ring, proxy, .. }) = self.inter_node.lock().take() {
            proxy.abort();
            *self.retired_ring.lock() = Some(ring);
        }
        self.bootstrap.abort();
    }

    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Every op calls this first: an aborted or failed communicator refuses new work.
    pub fn check_usable(&self) -> Result<()> {
        if self.is_aborted() {
            return Err(MkError::invalid_usage("the communicator was aborted; destroy it and create a new one"));
        }
        // async_error() first: it records a kernel's or the proxy's failure not yet seen.
        if self.async_error() == mkResult_t::mkSuccess {
            return Ok(());
        }
        self.async_error.refusal().map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_bigger_than_the_view_has_no_data_plane() {
        assert_eq!(data_plane_missing(&[0; 8]), None);
        assert_eq!(data_plane_missing(&node_of_ranks(&[0; 16], Some(8))), None, "two nodes of eight");
        assert!(data_plane_missing(&[0; 9]).unwrap().contains("9 ranks on one node"));
        // Uneven nodes: the biggest decides, on every rank alike.
        assert!(data_plane_missing(&[0, 1, 1, 1, 1, 1, 1, 1, 1, 1]).is_some());
    }

    #[test]
    fn nodes_by_host_and_by_ranks_per_node() {
        assert_eq!(node_of_ranks(&[5, 5, 9, 9], None), vec![0, 0, 1, 1]);
        assert_eq!(node_of_ranks(&[9, 5, 9, 5], None), vec![0, 1, 0, 1]);
        assert_eq!(node_of_ranks(&[1, 1, 1, 1, 1, 1], Some(2)), vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(node_of_ranks(&[1, 1, 1], Some(4)), vec![0, 0, 0]);
    }
}
