//! Communicator creation and teardown.

use super::config::{resolve, mkConfig_t};
use super::{comm_ref, guard, mkComm, mkComm_t, with_comm, write_out};
use crate::bootstrap::{root::start_root, UniqueId, UNIQUE_ID_BYTES};
use crate::comm::{Comm, CommConfig};
use crate::error::{mkResult_t, MkError, Result};
use std::os::raw::{c_char, c_int};

/// 128 opaque bytes naming a communicator: the bootstrap root's address and a random
/// secret. Made by `mkGetUniqueId` on one rank and passed to the others out of band (MPI,
/// a file, a TCP store). Treat it as a password: whoever holds it can join.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct mkUniqueId {
    pub internal: [c_char; 128],
}

const _: () = assert!(UNIQUE_ID_BYTES == 128);

impl mkUniqueId {
    fn decode(&self) -> Result<UniqueId> {
        let bytes: [u8; 128] = self.internal.map(|c| c as u8);
        UniqueId::from_bytes(&bytes)
    }
}

/// Creates a new unique id and starts its bootstrap root (a thread of the calling process
/// that lives until every rank has joined). Call it once per communicator, on one rank.
/// Honors MK_SOCKET_IFNAME for the address it listens on.
#[no_mangle]
pub unsafe extern "C" fn mkGetUniqueId(uniqueId: *mut mkUniqueId) -> mkResult_t {
    guard(None, "mkGetUniqueId", || {
        if uniqueId.is_null() {
            return Err(MkError::invalid_argument("uniqueId is NULL"));
        }
        let id = start_root()?;
        let mut out = mkUniqueId { internal: [0; 128] };
        for (d, s) in out.internal.iter_mut().zip(id.to_bytes()) {
            *d = s as c_char;
        }
        uniqueId.write(out);
        Ok(())
    })
}

fn init_into(comm: *mut mkComm_t, nranks: c_int, id: &mkUniqueId, rank: c_int, device: Option<i32>, config: Result<CommConfig>) -> Result<()> {
    if comm.is_null() {
        return Err(MkError::invalid_argument("comm (the output pointer) is NULL"));
    }
    // SAFETY: checked non-NULL; the caller provides room for one handle.
    unsafe { comm.write(std::ptr::null_mut()) };
    let id = id.decode()?;
    let c = Comm::init(&id, nranks, rank, device, config?)?;
    let handle = Box::into_raw(Box::new(mkComm { comm: c }));
    // SAFETY: as above.
    unsafe { comm.write(handle) };
    Ok(())
}

/// Creates this process's rank `rank` (0 ≤ rank < nranks) of the communicator named by
/// `commId`, on the current CUDA device (select it first with cudaSetDevice, as with NCCL).
/// Blocks until all `nranks` ranks have joined, or MK_BOOTSTRAP_TIMEOUT_MS passes
/// (`mkTimeout`). A duplicate rank or a different `nranks` on another rank gives
/// `mkInvalidUsage` on every rank. Without a usable CUDA driver it returns `mkSystemError`.
/// On failure `*comm` is set to NULL.
///
/// Ranks on several hosts (or grouped by MK_RANKS_PER_NODE) form nodes: each node maps a
/// workspace among its ranks, and each rank connects to the ranks with its local rank on
/// the other nodes over MK_NET (sockets, or RDMA in a build with the `rdma` feature) and
/// starts a proxy thread that carries its kernels' inter-node transfers.
#[no_mangle]
pub unsafe extern "C" fn mkCommInitRank(comm: *mut mkComm_t, nranks: c_int, commId: mkUniqueId, rank: c_int) -> mkResult_t {
    guard(None, "mkCommInitRank", || init_into(comm, nranks, &commId, rank, None, Ok(CommConfig::from_env())))
}

/// `mkCommInitRank` with a configuration (NULL: as mkCommInitRank). Initialise `config`
/// with `MK_CONFIG_INITIALIZER`, then set the fields you want.
#[no_mangle]
pub unsafe extern "C" fn mkCommInitRankConfig(
    comm: *mut mkComm_t,
    nranks: c_int,
    commId: mkUniqueId,
    rank: c_int,
    config: *const mkConfig_t,
) -> mkResult_t {
    guard(None, "mkCommInitRankConfig", || init_into(comm, nranks, &commId, rank, None, resolve(config)))
}

/// Creates `ndev` ranks of one communicator in this process: rank i runs on CUDA device
/// `devlist[i]` (devlist NULL: devices 0..ndev-1). A device may repeat, giving several
/// ranks on one GPU. Fills `comms[0..ndev]`; on failure every entry is NULL.
#[no_mangle]
pub unsafe extern "C" fn mkCommInitAll(comms: *mut mkComm_t, ndev: c_int, devlist: *const c_int) -> mkResult_t {
    guard(None, "mkCommInitAll", || {
        if comms.is_null() {
            return Err(MkError::invalid_argument("comms is NULL"));
        }
        if ndev <= 0 {
            return Err(MkError::invalid_argument(format!("ndev must be positive, got {ndev}")));
        }
        let n = ndev as usize;
        // SAFETY: the caller provides room for ndev handles.
        let out = std::slice::from_raw_parts_mut(comms, n);
        out.fill(std::ptr::null_mut());
        let devices: Vec<i32> = if devlist.is_null() {
            (0..ndev).collect()
        } else {
            // SAFETY: the caller provides ndev device ordinals.
            std::slice::from_raw_parts(devlist, n).to_vec()
        };
        crate::cuda::driver()?;
        let id = start_root()?;
        let config = CommConfig::from_env();
        let results: Vec<Result<Comm>> = std::thread::scope(|s| {
            let handles: Vec<_> = devices
                .iter()
                .enumerate()
                .map(|(rank, &dev)| {
                    let config = config.clone();
                    s.spawn(move || Comm::init(&id, ndev, rank as c_int, Some(dev), config))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(MkError::internal("init thread panicked"))))
                .collect()
        });
        // Report the root cause, not the timeouts it caused on the other ranks.
        if let Some(e) = results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .min_by_key(|e| (e.code == mkResult_t::mkTimeout) as u8)
        {
            return Err(e.clone());
        }
        for (slot, c) in out.iter_mut().zip(results) {
            *slot = Box::into_raw(Box::new(mkComm { comm: c.expect("checked above") }));
        }
        Ok(())
    })
}

/// Releases a communicator and everything it holds. Call it after the work queued on it
/// has completed (synchronise the streams first). NULL is rejected.
#[no_mangle]
pub unsafe extern "C" fn mkCommDestroy(comm: mkComm_t) -> mkResult_t {
    guard(None, "mkCommDestroy", || {
        comm_ref(comm)?;
        // SAFETY: the handle came from Box::into_raw in init and is destroyed once.
        let boxed = Box::from_raw(comm);
        let _ctx = boxed.comm.context.enter()?;
        drop(boxed);
        Ok(())
    })
}

/// Marks the communicator aborted (its kernels' waits and its peers stop), unblocks any
/// host-side wait on it, then releases it like mkCommDestroy. Use it after an error or a
/// timeout; the handle is invalid afterwards.
#[no_mangle]
pub unsafe extern "C" fn mkCommAbort(comm: mkComm_t) -> mkResult_t {
    let r = with_comm(comm, "mkCommAbort", |c| {
        c.abort();
        Ok(())
    });
    if r != mkResult_t::mkSuccess {
        return r;
    }
    mkCommDestroy(comm)
}

/// Reports an error that happened asynchronously (a peer timed out or failed inside a
/// kernel): mkSuccess while none has, else mkTimeout, mkRemoteError, ... Once it is set,
/// the communicator refuses new operations; abort and recreate it.
#[no_mangle]
pub unsafe extern "C" fn mkCommGetAsyncError(comm: mkComm_t, asyncError: *mut mkResult_t) -> mkResult_t {
    with_comm(comm, "mkCommGetAsyncError", |c| write_out(asyncError, c.async_error(), "asyncError"))
}
