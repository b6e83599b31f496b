//! The copy-engine baseline collective: an AllGather made of cuMemcpyAsync calls that
//! read every peer's shard straight from its memory mapped into this process (CUDA IPC),
//! as PyTorch's async tensor parallelism does on one node. No SM runs it: the copy engines
//! move the bytes, which is what a fused op competes with when it overlaps a GEMM.
//!
//! The shards are staged once (`stage`), so a timed `all_gather` is the peer reads alone,
//! without the cross-rank signal a real collective needs to know a shard is ready: it is a
//! lower bound on a copy-engine AllGather's time, which keeps the comparison on the
//! baseline's side.

use cudarc::driver::result as cu;
use mkernel::bootstrap::Bootstrap;
use mkernel::cuda::memory::DeviceBuffer;
use mkernel::cuda::{self, sys};
use mkernel::error::{MkError, Result};

/// Every rank's shard buffer, mapped here (index = rank; our own is `own`).
pub struct PeerShards {
    own: DeviceBuffer,
    peers: Vec<u64>,
    opened: Vec<u64>,
    bytes: usize,
}

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(MkError::new(
            mkernel::error::mkResult_t::mkUnhandledCudaError,
            format!("copy-engine baseline: {what} failed: {r:?}"),
        ))
    }
}

impl PeerShards {
    /// Allocates `bytes` per rank and maps every peer's allocation (a collective call:
    /// every rank calls it). Fails where CUDA IPC is unavailable (the bench then shows
    /// the baseline as absent, with the reason).
    pub fn new(bootstrap: &Bootstrap, rank: usize, nranks: usize, bytes: usize) -> Result<PeerShards> {
        let own = DeviceBuffer::alloc(bytes.max(1))?;
        let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: own.ptr is the base of a cuMemAlloc allocation.
        let exported = unsafe { sys::cuIpcGetMemHandle(&mut handle, own.ptr) };
        let mut mine = vec![u8::from(exported == sys::CUresult::CUDA_SUCCESS)];
        mine.extend(handle.reserved.iter().map(|&c| c as u8));
        let all = bootstrap.allgather(&mine)?;
        let mut shards = PeerShards { peers: vec![0; nranks], opened: Vec::new(), own, bytes };
        let opened = shards.open_peers(rank, &all);
        // Every rank learns whether every rank mapped every peer, so all of them keep the
        // baseline or all drop it (none waits for a rank that gave up).
        let verdicts = bootstrap.allgather(&[u8::from(opened.is_ok())])?;
        opened?;
        if let Some(r) = verdicts.iter().position(|v| v.first() != Some(&1)) {
            return Err(MkError::system(format!("copy-engine baseline: rank {r} could not map its peers' buffers")));
        }
        Ok(shards)
    }

    fn open_peers(&mut self, rank: usize, all: &[Vec<u8>]) -> Result<()> {
        for (r, h) in all.iter().enumerate() {
            if r == rank {
                self.peers[r] = self.own.ptr;
                continue;
            }
            if h.first() != Some(&1) || h.len() < 65 {
                return Err(MkError::system(format!(
                    "copy-engine baseline: rank {r} could not export its buffer (cuIpcGetMemHandle)"
                )));
            }
            let mut peer = sys::CUipcMemHandle_st { reserved: [0; 64] };
            for (d, s) in peer.reserved.iter_mut().zip(&h[1..65]) {
                *d = *s as _;
            }
            let mut p = 0u64;
            // SAFETY: a handle another process exported for a live allocation; closed in Drop.
            check("cuIpcOpenMemHandle", unsafe {
                sys::cuIpcOpenMemHandle_v2(&mut p, peer, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32)
            })?;
            self.peers[r] = p;
            self.opened.push(p);
        }
        Ok(())
    }

    /// Copies this rank's shard (`bytes` at `src`, at most the size given to `new`) into its
    /// exported buffer and waits for it; the caller barriers before the peers read it.
    pub fn stage(&self, src: u64, bytes: usize, stream: sys::CUstream) -> Result<()> {
        self.fits(bytes)?;
        // SAFETY: both hold at least `bytes`; the stream is live.
        unsafe {
            cu::memcpy_dtod_async(self.own.ptr, src, bytes, stream)
                .map_err(|e| cuda::cuda_err("cuMemcpyDtoDAsync", e))?;
            cu::stream::synchronize(stream).map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))
        }
    }

    /// The staged shards of `bytes` each, in rank order at `dst` (nranks × bytes): one copy
    /// per rank.
    pub fn all_gather(&self, dst: u64, bytes: usize, stream: sys::CUstream) -> Result<()> {
        self.fits(bytes)?;
        for (r, &src) in self.peers.iter().enumerate() {
            // SAFETY: src maps a peer's buffer of at least `bytes`; dst holds nranks × bytes.
            unsafe { cu::memcpy_dtod_async(dst + (r * bytes) as u64, src, bytes, stream) }
                .map_err(|e| cuda::cuda_err("cuMemcpyDtoDAsync", e))?;
        }
        Ok(())
    }

    fn fits(&self, bytes: usize) -> Result<()> {
        if bytes > self.bytes {
            return Err(MkError::invalid_argument(format!(
                "copy-engine baseline: a {bytes}-byte shard exceeds the {} bytes allocated",
                self.bytes
            )));
        }
        Ok(())
    }
}

impl Drop for PeerShards {
    fn drop(&mut self) {
        for &p in &self.opened {
            // SAFETY: opened by cuIpcOpenMemHandle in new, closed once.
            unsafe { sys::cuIpcCloseMemHandle(p) };
        }
    }
}
