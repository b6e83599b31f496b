//! NCCL's C API: the only `#[no_mangle]` code, and the only symbols the library exports
//! (nccl/exports.map). Each function dispatches on the mode (crate::real): standalone runs
//! it on mkernel or refuses it with `ncclInvalidUsage`; interpose runs AllReduce, AllGather
//! and ReduceScatter of mkernel's types and ops on mkernel and hands everything else to the
//! real NCCL, with the real communicator in place of the handle.
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

use crate::abi::*;
use crate::collectives::{self, CollOp, Queued};
use crate::error::{self, guard, note_real_result, set_thread_last_error, NcclError, Result};
use crate::group;
use crate::handle::{lookup, register, unregister, wraps_real, CommHandle, Route, Wrapping};
use crate::init::{self, parse_config, InitJob};
use crate::real::{self, Mode};
use mkernel::bootstrap::root::start_root;
use mkernel::comm::CommConfig;
use std::ffi::c_void;
use std::os::raw::{c_char, c_int};
use std::sync::atomic::Ordering;
use std::sync::Arc;

const PROVIDED: &str = "ncclAllReduce, ncclAllGather, ncclReduceScatter, ncclBroadcast, ncclBcast, ncclReduce, \
                        ncclGroupStart/End, communicator init, finalize, destroy, abort and queries";

fn standalone() -> Result<bool> {
    Ok(matches!(real::mode()?, Mode::Standalone(_)))
}

/// Runs a body that has no communicator.
fn plain(name: &str, body: impl FnOnce() -> Result<ncclResult_t>) -> ncclResult_t {
    guard(name, |_| {}, body)
}

/// Runs a body on a live communicator; its errors are also kept on the communicator.
fn on_comm(name: &str, comm: ncclComm_t, body: impl FnOnce(&Arc<CommHandle>) -> Result<ncclResult_t>) -> ncclResult_t {
    match lookup(comm) {
        Ok(h) => guard(name, |m| h.set_last_error(m), || body(&h)),
        Err(e) => guard(name, |_| {}, || Err(e)),
    }
}

/// NCCL's own entry points call its exported functions on its own communicators
/// (`ncclCommEnsureReady` asks `ncclCommGetAsyncError` before every query and collective;
/// `ncclBcast` is `ncclBroadcast` in place). Those calls bind to this library's
/// definitions, which come first in the process, and carry a real communicator: in
/// interpose mode one that a handle wraps goes straight back to the real NCCL, untouched by
/// this library's checks and last-error bookkeeping. Every entry point that takes a
/// communicator checks this first (docs/decisions/0047).
fn nccl_internal(comm: ncclComm_t) -> bool {
    matches!(real::mode(), Ok(Mode::Interpose(_))) && wraps_real(comm)
}

/// A call NCCL made on its own communicator, handed back to it.
fn pass_back(call: impl FnOnce() -> Result<ncclResult_t>) -> ncclResult_t {
    call().unwrap_or_else(|e| e.code)
}

/// Result of a call made to the real NCCL, remembered for ncclGetLastError.
fn from_real(rc: ncclResult_t) -> Result<ncclResult_t> {
    note_real_result(rc);
    Ok(rc)
}

/// An entry point standalone mode does not provide.
fn not_standalone(name: &str) -> NcclError {
    NcclError::invalid_usage(format!(
        "{name} is not provided in standalone mode (no real NCCL to hand it to); mkernel provides {PROVIDED}"
    ))
}

/// Interpose: a call on a communicator that goes to the real NCCL, after the mkernel attach
/// settled (so every rank issues its real calls in the same order).
fn forward(
    name: &'static str,
    comm: ncclComm_t,
    counted: Option<&str>,
    call: impl FnOnce(ncclComm_t) -> Result<ncclResult_t>,
) -> ncclResult_t {
    if !matches!(real::mode(), Ok(Mode::Interpose(_))) {
        return forward_plain(name, || Err(NcclError::internal("unreachable: standalone refuses first")));
    }
    if nccl_internal(comm) {
        return pass_back(|| call(comm));
    }
    on_comm(name, comm, |h| {
        let _ = h.mk_comm();
        if let Some(c) = counted {
            h.count(c, Route::Nccl);
        }
        from_real(call(h.real_comm())?)
    })
}

/// A call without a communicator: the real NCCL's in interpose mode, refused standalone.
fn forward_plain(name: &'static str, call: impl FnOnce() -> Result<ncclResult_t>) -> ncclResult_t {
    plain(name, || if standalone()? { Err(not_standalone(name)) } else { from_real(call()?) })
}

/// Runs or queues (inside a group) a collective on mkernel.
fn run_on_mkernel(h: &Arc<CommHandle>, op: CollOp, stream: cudaStream_t) -> Result<ncclResult_t> {
    op.check(h.nranks.max(1))?;
    if h.finalized.load(Ordering::Acquire) || h.finalizing.load(Ordering::Acquire) {
        return Err(NcclError::invalid_usage("the communicator was finalized (ncclCommFinalize); destroy it"));
    }
    h.count(op.name(), Route::Mkernel);
    if group::in_group() {
        group::defer_op(Queued { comm: h.clone(), op, stream: stream as usize });
        return Ok(ncclSuccess);
    }
    let mk = usable_mk(h)?;
    collectives::run(&mk, &op, stream as usize)?;
    Ok(ncclSuccess)
}

/// The mkernel communicator an op runs on (waiting for a pending init).
fn usable_mk(h: &CommHandle) -> Result<Arc<crate::handle::MkComm>> {
    match h.mk_comm()? {
        Some(mk) => Ok(mk),
        None if h.aborted.load(Ordering::Acquire) => {
            Err(NcclError::invalid_usage("the communicator was aborted (ncclCommAbort)"))
        }
        None => Err(NcclError::internal("the communicator has no mkernel side")),
    }
}

/// A collective that mkernel may run: standalone always; interpose when the communicator
/// has an mkernel side and mkernel runs the type and op, else the real NCCL.
fn collective(
    name: &'static str,
    comm: ncclComm_t,
    op: CollOp,
    stream: cudaStream_t,
    real_call: impl FnOnce(ncclComm_t) -> Result<ncclResult_t>,
) -> ncclResult_t {
    if nccl_internal(comm) {
        return pass_back(|| real_call(comm));
    }
    on_comm(name, comm, |h| {
        if standalone()? {
            return run_on_mkernel(h, op, stream);
        }
        let routable = matches!(op, CollOp::AllReduce { .. } | CollOp::AllGather { .. } | CollOp::ReduceScatter { .. })
            && op.check(h.nranks.max(1)).is_ok();
        if routable {
            if let Some(mk) = h.mk_comm()? {
                if op.runs_on_mkernel(mk.topology.spans_nodes()) {
                    return run_on_mkernel(h, op, stream);
                }
            }
        }
        let _ = h.mk_comm();
        h.count(op.name(), Route::Nccl);
        from_real(real_call(h.real_comm())?)
    })
}

// ---------------------------------------------------------------- versions, ids, errors

/// Writes NCCL_VERSION_CODE: the real NCCL's in interpose mode, 22809 (2.28.9, the release
/// whose nccl.h this library implements) standalone.
#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    plain("ncclGetVersion", || {
        if version.is_null() {
            return Err(NcclError::invalid_argument("version is NULL"));
        }
        if standalone()? {
            version.write(NCCL_VERSION_CODE);
            return Ok(ncclSuccess);
        }
        from_real(real::ncclGetVersion()?(version))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(uniqueId: *mut ncclUniqueId) -> ncclResult_t {
    plain("ncclGetUniqueId", || {
        if uniqueId.is_null() {
            return Err(NcclError::invalid_argument("uniqueId is NULL"));
        }
        if !standalone()? {
            return from_real(real::ncclGetUniqueId()?(uniqueId));
        }
        let id = start_root()?;
        let mut out = ncclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
        for (d, s) in out.internal.iter_mut().zip(id.to_bytes()) {
            *d = s as c_char;
        }
        uniqueId.write(out);
        Ok(ncclSuccess)
    })
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    if let Some(Ok(f)) = real::real().map(|_| real::ncclGetErrorString()) {
        // SAFETY: the real NCCL's function of this exact type.
        return unsafe { f(result) };
    }
    error::error_string(result).as_ptr()
}

/// The message of the last failed call on this thread (the real NCCL's when that call
/// failed inside it); a communicator's asynchronous error message when `comm` has one.
#[no_mangle]
pub unsafe extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    std::panic::catch_unwind(|| {
        if nccl_internal(comm) {
            if let Ok(f) = real::ncclGetLastError() {
                return f(comm);
            }
        }
        let h = if comm.is_null() { None } else { lookup(comm).ok() };
        if error::last_error_is_real() {
            if let Ok(f) = real::ncclGetLastError() {
                return f(h.as_ref().map_or(std::ptr::null_mut(), |h| h.real_comm()));
            }
        }
        if let Some(h) = h {
            if let Some(Ok(Some(mk))) = h.mk_state() {
                if mk.async_error() != mkernel::mkResult_t::mkSuccess {
                    return mk.last_error_ptr();
                }
            }
        }
        error::thread_last_error_ptr()
    })
    .unwrap_or(c"".as_ptr())
}

#[no_mangle]
pub extern "C" fn ncclResetDebugInit() {
    if let Some(Ok(f)) = real::real().map(|_| real::ncclResetDebugInit()) {
        // SAFETY: the real NCCL's function of this exact type.
        unsafe { f() }
    }
}

// ---------------------------------------------------------------- communicators

unsafe fn init_rank(
    name: &'static str,
    out: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    plain(name, || {
        if out.is_null() {
            return Err(NcclError::invalid_argument("comm (the output pointer) is NULL"));
        }
        out.write(std::ptr::null_mut());
        if nranks <= 0 {
            return Err(NcclError::invalid_argument(format!("nranks must be positive, got {nranks}")));
        }
        if rank < 0 || rank >= nranks {
            return Err(NcclError::invalid_argument(format!("rank {rank} is out of range [0, {nranks})")));
        }
        if !standalone()? {
            let mut real_comm: ncclComm_t = std::ptr::null_mut();
            let rc = if config.is_null() {
                real::ncclCommInitRank()?(&mut real_comm, nranks, id, rank)
            } else {
                real::ncclCommInitRankConfig()?(&mut real_comm, nranks, id, rank, config)
            };
            return wrap_real(rc, real_comm, rank as usize, nranks as usize, out);
        }
        let cfg = parse_config(config)?;
        let device = mkernel::cuda::current_device()?;
        let mut config = CommConfig::from_env();
        config.max_ctas = cfg.max_ctas.or(config.max_ctas);
        let h = CommHandle::new(rank as usize, nranks as usize, device, cfg.blocking, None);
        let job = InitJob { handle: h.clone(), id: id.internal.map(|c| c as u8), config };
        if group::in_group() {
            out.write(register(h));
            group::defer_init(job);
            return Ok(ncclSuccess);
        }
        if !cfg.blocking {
            out.write(register(h));
            init::start_inits(vec![job], false)?;
            return Ok(ncclInProgress);
        }
        init::run_init(job)?;
        out.write(register(h));
        Ok(ncclSuccess)
    })
}

/// Interpose: wraps a communicator the real NCCL made and attaches mkernel to it: at the
/// group's end inside a group, on a thread for a non-blocking one, else now.
unsafe fn wrap_real(
    rc: ncclResult_t,
    real_comm: ncclComm_t,
    rank: usize,
    nranks: usize,
    out: *mut ncclComm_t,
) -> Result<ncclResult_t> {
    note_real_result(rc);
    if (rc != ncclSuccess && rc != ncclInProgress) || real_comm.is_null() {
        return Ok(rc);
    }
    let device = mkernel::cuda::current_device().unwrap_or(-1);
    let h = CommHandle::new(rank, nranks, device, rc == ncclSuccess, Some(real_comm as usize));
    out.write(register(h.clone()));
    if group::in_group() {
        group::defer_attach(h);
    } else if rc == ncclInProgress {
        spawn_attach(h);
    } else {
        init::attach(&h);
    }
    Ok(rc)
}

fn spawn_attach(h: Arc<CommHandle>) {
    let h2 = h.clone();
    if std::thread::Builder::new().name("mk-nccl-attach".into()).spawn(move || init::attach(&h2)).is_err() {
        h.settle(crate::handle::MkSlot::Off("cannot start an attach thread".into()));
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    init_rank("ncclCommInitRank", comm, nranks, commId, rank, std::ptr::null_mut())
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    init_rank("ncclCommInitRankConfig", comm, nranks, commId, rank, config)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    newcomm: *mut ncclComm_t,
    nranks: c_int,
    myrank: c_int,
    nId: c_int,
    commIds: *mut ncclUniqueId,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    if matches!(real::mode(), Ok(Mode::Interpose(_))) {
        return plain("ncclCommInitRankScalable", || {
            if newcomm.is_null() {
                return Err(NcclError::invalid_argument("newcomm is NULL"));
            }
            let mut real_comm: ncclComm_t = std::ptr::null_mut();
            let rc = real::ncclCommInitRankScalable()?(&mut real_comm, nranks, myrank, nId, commIds, config);
            wrap_real(rc, real_comm, myrank.max(0) as usize, nranks.max(0) as usize, newcomm)
        });
    }
    // Standalone: mkernel's bootstrap has one root; the first id names it.
    if nId < 1 || commIds.is_null() {
        return plain("ncclCommInitRankScalable", || {
            Err(NcclError::invalid_argument(format!("nId must be at least 1 and commIds non-NULL (nId = {nId})")))
        });
    }
    init_rank("ncclCommInitRankScalable", newcomm, nranks, *commIds, myrank, config)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(comm: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) -> ncclResult_t {
    plain("ncclCommInitAll", || {
        if comm.is_null() {
            return Err(NcclError::invalid_argument("comm is NULL"));
        }
        if ndev <= 0 {
            return Err(NcclError::invalid_argument(format!("ndev must be positive, got {ndev}")));
        }
        let n = ndev as usize;
        let out = std::slice::from_raw_parts_mut(comm, n);
        out.fill(std::ptr::null_mut());
        let devices: Vec<c_int> =
            if devlist.is_null() { (0..ndev).collect() } else { std::slice::from_raw_parts(devlist, n).to_vec() };
        if !standalone()? {
            let mut reals = vec![std::ptr::null_mut(); n];
            let rc = real::ncclCommInitAll()?(reals.as_mut_ptr(), ndev, devlist);
            note_real_result(rc);
            if rc != ncclSuccess {
                return Ok(rc);
            }
            let handles: Vec<Arc<CommHandle>> = reals
                .iter()
                .enumerate()
                .map(|(i, r)| CommHandle::new(i, n, devices[i], true, Some(*r as usize)))
                .collect();
            std::thread::scope(|s| {
                for h in &handles {
                    s.spawn(move || init::attach(h));
                }
            });
            for (slot, h) in out.iter_mut().zip(handles) {
                *slot = register(h);
            }
            return Ok(ncclSuccess);
        }
        mkernel::cuda::driver()?;
        let id = start_root()?.to_bytes();
        let config = CommConfig::from_env();
        let handles: Vec<Arc<CommHandle>> =
            devices.iter().enumerate().map(|(i, &d)| CommHandle::new(i, n, d, true, None)).collect();
        let jobs = handles.iter().map(|h| InitJob { handle: h.clone(), id, config: config.clone() }).collect();
        init::start_inits(jobs, true)?;
        for (slot, h) in out.iter_mut().zip(handles) {
            *slot = register(h);
        }
        Ok(ncclSuccess)
    })
}

fn log_counts(h: &CommHandle, how: &str) {
    mkernel::mk_info!(
        Some(h.rank),
        "libmkernel-nccl: {how} rank {} of {}; calls {}",
        h.rank,
        h.nranks,
        h.counts_line()
    );
}

/// Waits for the work queued on the communicator's device to finish.
fn synchronize(h: &CommHandle) -> Result<()> {
    if let Some(mk) = h.mk_comm()? {
        let _ctx = mk.context.enter()?;
        mkernel::cuda::check("cuCtxSynchronize", unsafe { mkernel::cuda::sys::cuCtxSynchronize() })?;
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
    if nccl_internal(comm) {
        return pass_back(|| Ok(real::ncclCommFinalize()?(comm)));
    }
    on_comm("ncclCommFinalize", comm, |h| {
        if !standalone()? {
            let _ = h.mk_comm();
            return from_real(real::ncclCommFinalize()?(h.real_comm()));
        }
        if h.blocking {
            synchronize(h)?;
            h.finalized.store(true, Ordering::Release);
            return Ok(ncclSuccess);
        }
        h.finalizing.store(true, Ordering::Release);
        let h2 = h.clone();
        std::thread::Builder::new()
            .name("mk-nccl-finalize".into())
            .spawn(move || {
                if let Err(e) = synchronize(&h2) {
                    h2.set_last_error(&format!("ncclCommFinalize: {}", e.message));
                }
                h2.finalized.store(true, Ordering::Release);
                h2.finalizing.store(false, Ordering::Release);
            })
            .map_err(|e| NcclError::system(format!("cannot start a finalize thread: {e}")))?;
        Ok(ncclInProgress)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    if nccl_internal(comm) {
        return pass_back(|| Ok(real::ncclCommDestroy()?(comm)));
    }
    plain("ncclCommDestroy", || {
        let h = unregister(comm)?;
        let _ = h.mk_comm();
        log_counts(&h, "destroyed");
        drop(h.take_mk("destroyed"));
        if standalone()? {
            return Ok(ncclSuccess);
        }
        from_real(real::ncclCommDestroy()?(h.real_comm()))
    })
}

/// Stops the communicator's kernels and host waits (callable from another thread while one
/// is blocked on the communicator), then releases it. An init still running is abandoned:
/// its thread releases what it made when it finishes.
#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    if nccl_internal(comm) {
        return pass_back(|| Ok(real::ncclCommAbort()?(comm)));
    }
    plain("ncclCommAbort", || {
        let h = unregister(comm)?;
        h.aborted.store(true, Ordering::Release);
        if let Some(Ok(Some(mk))) = h.mk_state() {
            mk.abort();
        }
        log_counts(&h, "aborted");
        if standalone()? {
            drop(h.take_mk("aborted"));
            return Ok(ncclSuccess);
        }
        // The real communicator must outlive the attach's calls on it.
        let _ = h.mk_comm();
        drop(h.take_mk("aborted"));
        from_real(real::ncclCommAbort()?(h.real_comm()))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommRevoke(comm: ncclComm_t, revokeFlags: c_int) -> ncclResult_t {
    forward("ncclCommRevoke", comm, None, |c| Ok(real::ncclCommRevoke()?(c, revokeFlags)))
}

/// Interpose: a real communicator made from another (split, shrink), wrapped and attached.
unsafe fn derived(
    name: &'static str,
    comm: ncclComm_t,
    newcomm: *mut ncclComm_t,
    make: impl FnOnce(ncclComm_t, *mut ncclComm_t) -> Result<ncclResult_t>,
) -> ncclResult_t {
    if !matches!(real::mode(), Ok(Mode::Interpose(_))) {
        return forward_plain(name, || Err(NcclError::internal("unreachable: standalone refuses first")));
    }
    if nccl_internal(comm) {
        return pass_back(|| make(comm, newcomm));
    }
    on_comm(name, comm, |h| {
        if newcomm.is_null() {
            return Err(NcclError::invalid_argument("newcomm is NULL"));
        }
        newcomm.write(std::ptr::null_mut());
        let _ = h.mk_comm();
        let mut child: ncclComm_t = std::ptr::null_mut();
        let rc = make(h.real_comm(), &mut child)?;
        let (mut rank, mut nranks) = (0, 0);
        if rc == ncclSuccess && !child.is_null() {
            let _wrapping = Wrapping::new(child);
            real::ncclCommUserRank()?(child, &mut rank);
            real::ncclCommCount()?(child, &mut nranks);
        }
        wrap_real(rc, child, rank.max(0) as usize, nranks.max(0) as usize, newcomm)
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t {
    derived("ncclCommSplit", comm, newcomm, |c, out| Ok(real::ncclCommSplit()?(c, color, key, out, config)))
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommShrink(
    comm: ncclComm_t,
    excludeRanksList: *mut c_int,
    excludeRanksCount: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
    shrinkFlags: c_int,
) -> ncclResult_t {
    derived("ncclCommShrink", comm, newcomm, |c, out| {
        Ok(real::ncclCommShrink()?(c, excludeRanksList, excludeRanksCount, out, config, shrinkFlags))
    })
}

/// ncclInProgress while a non-blocking init (or the interpose attach) or finalize runs;
/// then the init's error, or the first asynchronous error of the communicator.
#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: ncclComm_t, asyncError: *mut ncclResult_t) -> ncclResult_t {
    if nccl_internal(comm) {
        return pass_back(|| Ok(real::ncclCommGetAsyncError()?(comm, asyncError)));
    }
    on_comm("ncclCommGetAsyncError", comm, |h| {
        if asyncError.is_null() {
            return Err(NcclError::invalid_argument("asyncError is NULL"));
        }
        let mk_code = match h.mk_state() {
            None => ncclInProgress,
            Some(Err(e)) => e.code,
            Some(Ok(Some(mk))) => error::code_of(mk.async_error()),
            Some(Ok(None)) => ncclSuccess,
        };
        if standalone()? {
            let finalizing = h.finalizing.load(Ordering::Acquire);
            asyncError.write(if mk_code == ncclSuccess && finalizing { ncclInProgress } else { mk_code });
            return Ok(ncclSuccess);
        }
        let rc = real::ncclCommGetAsyncError()?(h.real_comm(), asyncError);
        if rc == ncclSuccess && *asyncError == ncclSuccess {
            asyncError.write(mk_code);
        }
        from_real(rc)
    })
}

unsafe fn query(
    name: &'static str,
    comm: ncclComm_t,
    out: *mut c_int,
    local: impl FnOnce(&CommHandle) -> c_int,
    real_fn: fn() -> Result<real::types::ncclCommCount>,
) -> ncclResult_t {
    if nccl_internal(comm) {
        return pass_back(|| Ok(real_fn()?(comm, out)));
    }
    on_comm(name, comm, |h| {
        if out.is_null() {
            return Err(NcclError::invalid_argument(format!("{name}: the output pointer is NULL")));
        }
        if standalone()? {
            out.write(local(h));
            return Ok(ncclSuccess);
        }
        from_real(real_fn()?(h.real_comm(), out))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    query("ncclCommCount", comm, count, |h| h.nranks as c_int, real::ncclCommCount)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    query("ncclCommCuDevice", comm, device, |h| h.device, real::ncclCommCuDevice)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    query("ncclCommUserRank", comm, rank, |h| h.rank as c_int, real::ncclCommUserRank)
}

// ---------------------------------------------------------------- memory and registration

#[no_mangle]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    forward_plain("ncclMemAlloc", || Ok(real::ncclMemAlloc()?(ptr, size)))
}

#[no_mangle]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    forward_plain("ncclMemFree", || Ok(real::ncclMemFree()?(ptr)))
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    forward("ncclCommRegister", comm, None, |c| Ok(real::ncclCommRegister()?(c, buff, size, handle)))
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    forward("ncclCommDeregister", comm, None, |c| Ok(real::ncclCommDeregister()?(c, handle)))
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    winFlags: c_int,
) -> ncclResult_t {
    forward("ncclCommWindowRegister", comm, None, |c| Ok(real::ncclCommWindowRegister()?(c, buff, size, win, winFlags)))
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t {
    forward("ncclCommWindowDeregister", comm, None, |c| Ok(real::ncclCommWindowDeregister()?(c, win)))
}

#[no_mangle]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut ncclRedOp_t,
    scalar: *mut c_void,
    datatype: ncclDataType_t,
    residence: ncclScalarResidence_t,
    comm: ncclComm_t,
) -> ncclResult_t {
    forward("ncclRedOpCreatePreMulSum", comm, None, |c| {
        Ok(real::ncclRedOpCreatePreMulSum()?(op, scalar, datatype, residence, c))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclRedOpDestroy(op: ncclRedOp_t, comm: ncclComm_t) -> ncclResult_t {
    forward("ncclRedOpDestroy", comm, None, |c| Ok(real::ncclRedOpDestroy()?(op, c)))
}

// ---------------------------------------------------------------- collectives

#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = CollOp::AllReduce { send: sendbuff as usize, recv: recvbuff as usize, count, dtype: datatype, op };
    collective("ncclAllReduce", comm, o, stream, |c| {
        Ok(real::ncclAllReduce()?(sendbuff, recvbuff, count, datatype, op, c, stream))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = CollOp::AllGather { send: sendbuff as usize, recv: recvbuff as usize, count: sendcount, dtype: datatype };
    collective("ncclAllGather", comm, o, stream, |c| {
        Ok(real::ncclAllGather()?(sendbuff, recvbuff, sendcount, datatype, c, stream))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = CollOp::ReduceScatter {
        send: sendbuff as usize,
        recv: recvbuff as usize,
        count: recvcount,
        dtype: datatype,
        op,
    };
    collective("ncclReduceScatter", comm, o, stream, |c| {
        Ok(real::ncclReduceScatter()?(sendbuff, recvbuff, recvcount, datatype, op, c, stream))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = CollOp::Broadcast { send: sendbuff as usize, recv: recvbuff as usize, count, dtype: datatype, root };
    collective("ncclBroadcast", comm, o, stream, |c| {
        Ok(real::ncclBroadcast()?(sendbuff, recvbuff, count, datatype, root, c, stream))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = CollOp::Broadcast { send: buff as usize, recv: buff as usize, count, dtype: datatype, root };
    collective("ncclBcast", comm, o, stream, |c| Ok(real::ncclBcast()?(buff, count, datatype, root, c, stream)))
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = CollOp::Reduce { send: sendbuff as usize, recv: recvbuff as usize, count, dtype: datatype, op, root };
    collective("ncclReduce", comm, o, stream, |c| {
        Ok(real::ncclReduce()?(sendbuff, recvbuff, count, datatype, op, root, c, stream))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    forward("ncclAlltoAll", comm, Some("AlltoAll"), |c| {
        Ok(real::ncclAlltoAll()?(sendbuff, recvbuff, count, datatype, c, stream))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    forward("ncclGather", comm, Some("Gather"), |c| {
        Ok(real::ncclGather()?(sendbuff, recvbuff, count, datatype, root, c, stream))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    forward("ncclScatter", comm, Some("Scatter"), |c| {
        Ok(real::ncclScatter()?(sendbuff, recvbuff, count, datatype, root, c, stream))
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    forward("ncclSend", comm, Some("Send"), |c| Ok(real::ncclSend()?(sendbuff, count, datatype, peer, c, stream)))
}

#[no_mangle]
pub unsafe extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    forward("ncclRecv", comm, Some("Recv"), |c| Ok(real::ncclRecv()?(recvbuff, count, datatype, peer, c, stream)))
}

// ---------------------------------------------------------------- groups

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    plain("ncclGroupStart", || {
        let is_standalone = standalone()?;
        group::start();
        if is_standalone {
            return Ok(ncclSuccess);
        }
        // SAFETY: the real NCCL's function of this exact type.
        from_real(unsafe { real::ncclGroupStart()?() })
    })
}

/// Releases a group's held work: inits (standalone; all blocking ones waited for),
/// mkernel attaches (interpose, after the real ncclGroupEnd made the communicators), then
/// collectives in call order. Returns the first error, else ncclInProgress when a
/// non-blocking communicator is still being made.
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    plain("ncclGroupEnd", || {
        let is_standalone = standalone()?;
        if group::depth() == 0 {
            return Err(NcclError::invalid_usage("ncclGroupEnd called without a matching ncclGroupStart"));
        }
        let real_rc = if is_standalone {
            ncclSuccess
        } else {
            // SAFETY: the real NCCL's function of this exact type.
            let rc = unsafe { real::ncclGroupEnd()?() };
            note_real_result(rc);
            rc
        };
        let Some(work) = group::end()? else { return Ok(real_rc) };
        let mut rc = real_rc;
        if !work.inits.is_empty() {
            let wait = work.inits.iter().all(|j| j.handle.blocking);
            init::start_inits(work.inits, wait)?;
            if !wait {
                rc = ncclInProgress;
            }
        }
        if !work.attaches.is_empty() {
            if work.attaches.iter().all(|h| h.blocking) && real_rc == ncclSuccess {
                std::thread::scope(|s| {
                    for h in &work.attaches {
                        s.spawn(move || init::attach(h));
                    }
                });
            } else {
                work.attaches.into_iter().for_each(spawn_attach);
            }
        }
        let mut first: Option<NcclError> = None;
        for q in work.ops {
            let r = usable_mk(&q.comm).and_then(|mk| collectives::run(&mk, &q.op, q.stream));
            if let Err(e) = r {
                q.comm.set_last_error(&format!("ncclGroupEnd ({}): {}", q.op.name(), e.message));
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => Err(NcclError::new(e.code, format!("a grouped collective failed: {}", e.message))),
            None => Ok(rc),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclGroupSimulateEnd(simInfo: *mut ncclSimInfo_t) -> ncclResult_t {
    forward_plain("ncclGroupSimulateEnd", || Ok(real::ncclGroupSimulateEnd()?(simInfo)))
}

/// The thread's last message (for tests of the error paths).
pub fn last_error() -> String {
    error::thread_last_error()
}

/// Records a message as the thread's last error (for tests).
pub fn set_last_error(message: &str) {
    set_thread_last_error(message)
}
