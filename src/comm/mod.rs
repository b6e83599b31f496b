//! The communicator: rank, size, device context, bootstrap, configuration, and the error
//! state (`mkGetLastError`, `mkCommGetAsyncError`, abort).

pub mod topology;
pub mod workspace;

use crate::bootstrap::{Bootstrap, UniqueId};
use crate::cuda::PrimaryContext;
use crate::error::{mkResult_t, MkError, Result};
use crate::mk_info;
use parking_lot::Mutex;
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

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
        }
    }
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

pub struct Comm {
    /// The NVLink data plane (declared first: dropped before the context it lives in).
    /// None when the ranks span several nodes or exceed MK_MAX_PEERS; `data_plane_missing`
    /// then says why.
    pub workspace: Option<workspace::SymmetricWorkspace>,
    pub data_plane_missing: Option<String>,
    pub rank: usize,
    pub nranks: usize,
    pub context: PrimaryContext,
    pub bootstrap: Bootstrap,
    pub config: CommConfig,
    /// Node index of every rank.
    pub nodes: Vec<usize>,
    last_error: Mutex<CString>,
    async_error: AtomicI32,
    aborted: AtomicBool,
}

impl Comm {
    /// Joins the communicator `id` as `rank` of `nranks` on `device` (the caller's current
    /// device when None).
    pub fn init(id: &UniqueId, nranks: i32, rank: i32, device: Option<i32>, config: CommConfig) -> Result<Comm> {
        if nranks <= 0 {
            return Err(MkError::invalid_argument(format!("nranks must be positive, got {nranks}")));
        }
        if rank < 0 || rank >= nranks {
            return Err(MkError::invalid_argument(format!("rank {rank} is out of range [0, {nranks})")));
        }
        let device = match device {
            Some(d) => d,
            None => crate::cuda::current_device()?,
        };
        let context = PrimaryContext::retain(device)?;
        let bootstrap = Bootstrap::join(id, rank as usize, nranks as usize, config.bootstrap_timeout)?;
        let nodes = node_of_ranks(bootstrap.host_hashes(), config.ranks_per_node);
        let (workspace, data_plane_missing) = if nodes.iter().any(|&n| n != nodes[0]) {
            (None, Some("the ranks span several nodes; collectives across nodes are not implemented yet".to_string()))
        } else if nranks as usize > crate::kernel_abi::MK_MAX_PEERS {
            (None, Some(format!("{nranks} ranks on one node; the NVLink data plane maps at most {}", crate::kernel_abi::MK_MAX_PEERS)))
        } else {
            let _g = context.enter()?;
            (Some(workspace::SymmetricWorkspace::create(&bootstrap, rank as usize, nranks as usize, &context, &config)?), None)
        };
        mk_info!(Some(rank as usize), "communicator ready: {nranks} ranks, device {device}, {} node(s)", nodes.iter().max().map_or(1, |m| m + 1));
        Ok(Comm {
            workspace,
            data_plane_missing,
            rank: rank as usize,
            nranks: nranks as usize,
            context,
            bootstrap,
            config,
            nodes,
            last_error: Mutex::new(CString::default()),
            async_error: AtomicI32::new(mkResult_t::mkSuccess as i32),
            aborted: AtomicBool::new(false),
        })
    }

    pub fn set_last_error(&self, message: &str) {
        *self.last_error.lock() = CString::new(message.replace('\0', " ")).unwrap_or_default();
    }

    /// Pointer to the last error message; valid until the next error on this comm.
    pub fn last_error_ptr(&self) -> *const std::os::raw::c_char {
        self.last_error.lock().as_ptr()
    }

    /// Records an asynchronous error (the first one wins) for `mkCommGetAsyncError`.
    pub fn record_async_error(&self, e: &MkError) {
        let _ = self.async_error.compare_exchange(
            mkResult_t::mkSuccess as i32,
            e.code as i32,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        self.set_last_error(&e.message);
    }

    pub fn async_error(&self) -> mkResult_t {
        // A kernel of this rank may have recorded a timeout or a peer's failure.
        if let Some(word) = self.workspace.as_ref().map(|w| w.error_word()).filter(|&w| w != 0) {
            if self.async_error.load(Ordering::Acquire) == mkResult_t::mkSuccess as i32 {
                self.record_async_error(&crate::ops::collectives::ErrorWord(word).to_error(self.rank));
            }
        }
        mkResult_t::from_i32(self.async_error.load(Ordering::Acquire))
    }

    /// Marks the communicator aborted and unblocks any host-side wait.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        if let Some(ws) = &self.workspace {
            ws.raise_host_abort();
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
        match self.async_error() {
            mkResult_t::mkSuccess => Ok(()),
            code => Err(MkError::new(
                code,
                "the communicator hit an earlier asynchronous error (see mkCommGetAsyncError); destroy it and create a new one",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_by_host_and_by_ranks_per_node() {
        assert_eq!(node_of_ranks(&[5, 5, 9, 9], None), vec![0, 0, 1, 1]);
        assert_eq!(node_of_ranks(&[9, 5, 9, 5], None), vec![0, 1, 0, 1]);
        assert_eq!(node_of_ranks(&[1, 1, 1, 1, 1, 1], Some(2)), vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(node_of_ranks(&[1, 1, 1], Some(4)), vec![0, 0, 0]);
    }
}
