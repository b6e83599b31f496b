//! Communicator creation and teardown.

use super::config::{mkConfig_t, resolve};
use super::handles::Ending;
use super::{end_comm, guard, mkComm_t, register, with_comm, write_out};
use crate::bootstrap::{root::start_root, UniqueId, MAX_RANKS, UNIQUE_ID_BYTES};
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

/// Creates a new unique id and starts its bootstrap root: a thread of the calling process
/// that ends once every rank has joined, when the first rank's MK_BOOTSTRAP_TIMEOUT_MS
/// passes, or after an hour in which no rank joined. Call it once per communicator, on
/// one rank.
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

fn init_into(
    comm: *mut mkComm_t,
    nranks: c_int,
    id: &mkUniqueId,
    rank: c_int,
    device: Option<i32>,
    config: Result<CommConfig>,
) -> Result<()> {
    if comm.is_null() {
        return Err(MkError::invalid_argument("comm (the output pointer) is NULL"));
    }
    // SAFETY: checked non-NULL; the caller provides room for one handle.
    unsafe { comm.write(std::ptr::null_mut()) };
    let config = config?;
    let id = id.decode()?;
    let c = Comm::init(&id, nranks, rank, device, config)?;
    // SAFETY: as above.
    unsafe { comm.write(register(c)) };
    Ok(())
}

/// Creates this process's rank `rank` (0 ≤ rank < nranks) of the communicator named by
/// `commId`, on the current CUDA device (select it first with cudaSetDevice, as with NCCL).
/// `nranks` is at most 65536 (else mkInvalidArgument). Blocks until all `nranks` ranks have
/// joined, or MK_BOOTSTRAP_TIMEOUT_MS passes (`mkTimeout`). A duplicate rank or a different
/// `nranks` on another rank gives `mkInvalidUsage` on every rank. On failure `*comm` is set
/// to NULL.
///
/// Platform: without a usable CUDA driver it returns `mkSystemError`; a driver older than
/// CUDA 13.0 (cuDriverGetVersion < 13000) is `mkSystemError` and a GPU other than compute
/// capability 9.0 (H100, H200, GH200) is `mkInvalidUsage`, each with a message naming what
/// was found and what is required.
///
/// Ranks on several hosts (or grouped by MK_RANKS_PER_NODE) form nodes: each node maps a
/// workspace among its ranks, and each rank connects to the ranks with its local rank on
/// the other nodes over MK_NET (sockets, or RDMA where libibverbs and a device exist) and
/// starts a proxy thread that carries its kernels' inter-node transfers.
#[no_mangle]
pub unsafe extern "C" fn mkCommInitRank(
    comm: *mut mkComm_t,
    nranks: c_int,
    commId: mkUniqueId,
    rank: c_int,
) -> mkResult_t {
    guard(None, "mkCommInitRank", || init_into(comm, nranks, &commId, rank, None, Ok(CommConfig::from_env())))
}

/// `mkCommInitRank` with a configuration (NULL: as mkCommInitRank). Initialise `config`
/// with `MK_CONFIG_INITIALIZER` (or mkConfigInit), then set the fields you want. The library
/// reads `config->size` first and then at most that many bytes; see mkConfig_t for the
/// rules on `size`, `magic` and `version` (each violation is mkInvalidArgument).
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
/// ranks on one GPU. `ndev` is at most 65536. Fills `comms[0..ndev]`; on failure every
/// entry is NULL. Platform errors as mkCommInitRank.
#[no_mangle]
pub unsafe extern "C" fn mkCommInitAll(comms: *mut mkComm_t, ndev: c_int, devlist: *const c_int) -> mkResult_t {
    guard(None, "mkCommInitAll", || {
        if comms.is_null() {
            return Err(MkError::invalid_argument("comms is NULL"));
        }
        if ndev <= 0 {
            return Err(MkError::invalid_argument(format!("ndev must be positive, got {ndev}")));
        }
        if ndev as usize > MAX_RANKS {
            return Err(MkError::invalid_argument(format!(
                "ndev = {ndev} exceeds the {MAX_RANKS} ranks a communicator may have"
            )));
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
        if let Some(e) =
            results.iter().filter_map(|r| r.as_ref().err()).min_by_key(|e| (e.code == mkResult_t::mkTimeout) as u8)
        {
            return Err(e.clone());
        }
        for (slot, c) in out.iter_mut().zip(results) {
            *slot = register(c.expect("checked above"));
        }
        Ok(())
    })
}

/// Releases a communicator and everything it holds. Call it after the work queued on it
/// has completed (synchronise the streams first).
///
/// Safe while another thread is inside a call on `comm`: later calls are refused at once,
/// and the release waits for the calls inside to return (at most MK_TIMEOUT_MS; a call still
/// inside then releases the communicator itself when it returns). Afterwards every call on
/// the handle, a second mkCommDestroy included, is mkInvalidArgument saying it was destroyed;
/// NULL and handles this library did not make are mkInvalidArgument too.
#[no_mangle]
pub unsafe extern "C" fn mkCommDestroy(comm: mkComm_t) -> mkResult_t {
    guard(None, "mkCommDestroy", || end_comm(comm, Ending::Destroyed))
}

/// Aborts a communicator and releases it: its kernels stop waiting (on every rank, which
/// then reports mkRemoteError), host-side waits on it return, its proxy and connections
/// stop; then it is released as by mkCommDestroy. Use it after an error or a timeout.
///
/// Callable from any thread at any time, also while another thread is inside a call on
/// `comm` or blocked in a stream synchronisation on its work (NCCL's watchdog pattern):
/// the work in flight stops promptly, calls in progress return, and the release waits for
/// them to leave. Afterwards every call on the handle is mkInvalidArgument saying it was
/// aborted.
#[no_mangle]
pub unsafe extern "C" fn mkCommAbort(comm: mkComm_t) -> mkResult_t {
    guard(None, "mkCommAbort", || end_comm(comm, Ending::Aborted))
}

/// Reports an error that happened asynchronously (a peer timed out or failed inside a
/// kernel): mkSuccess while none has, else mkTimeout, mkRemoteError, ... Once it is set,
/// the communicator refuses new operations with that code; abort and recreate it. The first
/// asynchronous error also becomes the communicator's message: mkGetLastError(comm)
/// describes it (which op, which peer), and so does the message of every refused operation.
#[no_mangle]
pub unsafe extern "C" fn mkCommGetAsyncError(comm: mkComm_t, asyncError: *mut mkResult_t) -> mkResult_t {
    with_comm(comm, "mkCommGetAsyncError", |c| write_out(asyncError, c.async_error(), "asyncError"))
}
