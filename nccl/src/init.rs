//! Creating the mkernel side of communicators: standalone inits (possibly several ranks of
//! one GPU, from one thread inside a group, or non-blocking), and in interpose mode the
//! attach of an mkernel communicator to a real NCCL one.

use crate::abi::*;
use crate::error::{NcclError, Result};
use crate::handle::{CommHandle, MkComm, MkSlot};
use crate::real;
use mkernel::bootstrap::root::start_root;
use mkernel::bootstrap::{UniqueId, UNIQUE_ID_BYTES};
use mkernel::comm::{Comm, CommConfig};
use mkernel::cuda::{check, sys, PrimaryContext};
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::raw::c_int;
use std::sync::Arc;
use std::time::Duration;

/// What this library reads from an ncclConfig_t.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParsedConfig {
    pub blocking: bool,
    pub max_ctas: Option<u32>,
}

/// Reads `blocking` and `maxCTAs` (mkernel's grid cap) from a caller's ncclConfig_t; the
/// other fields tune NCCL's own transports and are accepted and ignored. As NCCL: the magic
/// must be NCCL_CONFIG_INITIALIZER's, and fields past `size` (an older header) count as unset.
///
/// # Safety
/// A non-NULL `config` must point to `config->size` readable bytes.
pub unsafe fn parse_config(config: *const ncclConfig_t) -> Result<ParsedConfig> {
    let mut out = ParsedConfig { blocking: true, max_ctas: None };
    let Some(c) = config.as_ref() else { return Ok(out) };
    if c.magic != NCCL_CONFIG_MAGIC {
        return Err(NcclError::invalid_argument(format!(
            "config->magic is {:#x}, not {NCCL_CONFIG_MAGIC:#x}: initialise ncclConfig_t with NCCL_CONFIG_INITIALIZER",
            c.magic
        )));
    }
    let has = |offset: usize| offset + 4 <= c.size;
    if has(std::mem::offset_of!(ncclConfig_t, blocking)) && c.blocking != NCCL_CONFIG_UNDEF_INT {
        if c.blocking != 0 && c.blocking != 1 {
            return Err(NcclError::invalid_argument(format!("config->blocking is {}, must be 0 or 1", c.blocking)));
        }
        out.blocking = c.blocking == 1;
    }
    if has(std::mem::offset_of!(ncclConfig_t, maxCTAs)) && c.maxCTAs != NCCL_CONFIG_UNDEF_INT {
        if c.maxCTAs <= 0 {
            return Err(NcclError::invalid_argument(format!("config->maxCTAs is {}, must be positive", c.maxCTAs)));
        }
        out.max_ctas = Some(c.maxCTAs as u32);
    }
    Ok(out)
}

/// One standalone rank to create.
pub struct InitJob {
    pub handle: Arc<CommHandle>,
    pub id: [u8; UNIQUE_ID_BYTES],
    pub config: CommConfig,
}

fn create(job: &InitJob) -> Result<MkComm> {
    let id = UniqueId::from_bytes(&job.id)?;
    let h = &job.handle;
    Ok(MkComm::new(Comm::init(&id, h.nranks as i32, h.rank as i32, Some(h.device), job.config.clone())?))
}

/// Runs one init on the calling thread and settles the handle; returns the outcome.
pub fn run_init(job: InitJob) -> Result<()> {
    let r = create(&job);
    let (slot, out) = match r {
        Ok(c) => (MkSlot::Ready(Arc::new(c)), Ok(())),
        Err(e) => (MkSlot::Failed(e.clone()), Err(e)),
    };
    job.handle.settle(slot);
    out
}

/// Ranks of this process that share a GPU must fit on it together (their kernels wait for
/// each other): where neither the config nor MK_MAX_CTAS caps the grid, each of the k ranks
/// on a device gets SMs / k CTAs.
pub fn share_devices(jobs: &mut [InitJob]) {
    let mut per_device: HashMap<i32, u32> = HashMap::new();
    for j in jobs.iter() {
        *per_device.entry(j.handle.device).or_default() += 1;
    }
    for j in jobs.iter_mut() {
        let k = per_device[&j.handle.device];
        if k > 1 && j.config.max_ctas.is_none() {
            if let Ok(sms) = mkernel::cuda::sm_count(j.handle.device) {
                j.config.max_ctas = Some((sms as u32 / k).max(1));
            }
        }
    }
}

/// Starts every init on its own thread (they rendezvous with each other). Blocking: waits
/// and returns the root cause of any failure (not the timeouts it caused elsewhere).
/// Non-blocking: returns at once; ncclCommGetAsyncError reports ncclInProgress until done.
pub fn start_inits(mut jobs: Vec<InitJob>, wait: bool) -> Result<()> {
    share_devices(&mut jobs);
    let threads: Vec<_> = jobs
        .into_iter()
        .map(|job| {
            let h = job.handle.clone();
            std::thread::Builder::new().name("mk-nccl-init".into()).spawn(move || run_init(job)).map_err(|e| {
                let err = NcclError::system(format!("cannot start an init thread: {e}"));
                h.settle(MkSlot::Failed(err.clone()));
                err
            })
        })
        .collect();
    if !wait {
        return threads.into_iter().find_map(|t| t.err()).map_or(Ok(()), Err);
    }
    let results: Vec<Result<()>> = threads
        .into_iter()
        .map(|t| t.and_then(|t| t.join().unwrap_or_else(|_| Err(NcclError::internal("an init thread panicked")))))
        .collect();
    match results.iter().filter_map(|r| r.as_ref().err()).min_by_key(|e| e.message.contains("timed out") as u8) {
        Some(e) => Err(e.clone()),
        None => Ok(()),
    }
}

/// A device buffer and stream for the attach's exchanges over the real communicator.
struct Scratch {
    stream: sys::CUstream,
    buf: sys::CUdeviceptr,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: both were created by `attach_inner` in the context current here.
        unsafe {
            sys::cuStreamSynchronize(self.stream);
            sys::cuMemFree_v2(self.buf);
            sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

/// Waits for the real communicator to finish the operation that returned `rc` (polling a
/// non-blocking one), then for the stream.
fn finish_real(rc: ncclResult_t, comm: ncclComm_t, stream: sys::CUstream, what: &str) -> Result<()> {
    let mut state = rc;
    while state == ncclInProgress {
        std::thread::sleep(Duration::from_millis(1));
        // SAFETY: a live real communicator and one out-int.
        let r = unsafe { real::ncclCommGetAsyncError()?(comm, &mut state) };
        if r != ncclSuccess {
            state = r;
        }
    }
    if state != ncclSuccess {
        return Err(NcclError::new(state, format!("the real NCCL's {what} failed with ncclResult_t {state}")));
    }
    check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream) }).map_err(NcclError::from)
}

/// Interpose mode: after the real communicator is ready, creates an mkernel communicator
/// over the same ranks (rank 0's mkernel unique id travels by the real ncclBroadcast) and
/// keeps it only if every rank made one (an ncclAllReduce(min) of the outcome), so that all
/// ranks route each call the same way. Settles the handle either way.
pub fn attach(h: &Arc<CommHandle>) {
    let slot = match wait_real_ready(h).and_then(|()| attach_inner(h)) {
        Ok(c) => {
            mkernel::mk_info!(
                Some(h.rank),
                "libmkernel-nccl: rank {} of {} has an mkernel communicator",
                h.rank,
                h.nranks
            );
            MkSlot::Ready(Arc::new(c))
        }
        Err(e) => {
            mkernel::mk_info!(
                Some(h.rank),
                "libmkernel-nccl: every call of this communicator goes to NCCL: {}",
                e.message
            );
            MkSlot::Off(e.message)
        }
    };
    h.settle(slot);
}

fn wait_real_ready(h: &CommHandle) -> Result<()> {
    if std::env::var("MK_NCCL_ROUTE").is_ok_and(|v| v.trim() == "nccl") {
        return Err(NcclError::invalid_usage("MK_NCCL_ROUTE=nccl"));
    }
    let mut state = ncclInProgress;
    while state == ncclInProgress {
        // SAFETY: the real communicator this handle wraps, alive until destroy.
        let r = unsafe { real::ncclCommGetAsyncError()?(h.real_comm(), &mut state) };
        if r != ncclSuccess {
            state = r;
        }
        if state == ncclInProgress {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    if state != ncclSuccess {
        return Err(NcclError::new(state, format!("the real communicator failed (ncclResult_t {state})")));
    }
    Ok(())
}

/// Every rank reaches both real collectives whatever mkernel does locally (a bootstrap root
/// that does not start, an init that fails), so no rank waits for a peer that gave up. Only
/// a failure of CUDA itself before the broadcast (no context, no memory) returns early; NCCL
/// cannot run on such a rank either.
fn attach_inner(h: &CommHandle) -> Result<MkComm> {
    let comm = h.real_comm();
    let (mut nranks, mut rank, mut device) = (0 as c_int, 0 as c_int, 0 as c_int);
    // SAFETY: a ready real communicator and out-ints.
    unsafe {
        real_ok(real::ncclCommCount()?(comm, &mut nranks), "ncclCommCount")?;
        real_ok(real::ncclCommUserRank()?(comm, &mut rank), "ncclCommUserRank")?;
        real_ok(real::ncclCommCuDevice()?(comm, &mut device), "ncclCommCuDevice")?;
    }
    let context = PrimaryContext::retain(device)?;
    let _ctx = context.enter()?;
    let mut scratch = Scratch { stream: std::ptr::null_mut(), buf: 0 };
    // SAFETY: creates a stream and a 256-byte buffer in the current (device's) context.
    unsafe {
        check("cuStreamCreate", sys::cuStreamCreate(&mut scratch.stream, 1 /* CU_STREAM_NON_BLOCKING */))?;
        if let Err(e) = check("cuMemAlloc", sys::cuMemAlloc_v2(&mut scratch.buf, 256)) {
            sys::cuStreamDestroy_v2(scratch.stream);
            return Err(e.into());
        }
    }
    // The id, then a byte saying rank 0 could make one.
    let mut msg = [0u8; UNIQUE_ID_BYTES + 1];
    if rank == 0 {
        match start_root() {
            Ok(id) => {
                msg[..UNIQUE_ID_BYTES].copy_from_slice(&id.to_bytes());
                msg[UNIQUE_ID_BYTES] = 1;
            }
            Err(e) => mkernel::mk_warn!(Some(0), "libmkernel-nccl: no mkernel bootstrap root: {}", e.message),
        }
    }
    let buf = scratch.buf as *mut c_void;
    // SAFETY: host and device buffers of the sizes given; the real broadcast of msg.len() bytes.
    unsafe {
        check("cuMemcpyHtoD", sys::cuMemcpyHtoD_v2(scratch.buf, msg.as_ptr().cast(), msg.len()))?;
        let rc = real::ncclBroadcast()?(
            buf,
            buf,
            msg.len(),
            1, /* ncclUint8 */
            0,
            comm,
            scratch.stream as cudaStream_t,
        );
        finish_real(rc, comm, scratch.stream, "ncclBroadcast of mkernel's unique id")?;
        check("cuMemcpyDtoH", sys::cuMemcpyDtoH_v2(msg.as_mut_ptr().cast(), scratch.buf, msg.len()))?;
    }
    let made: Result<MkComm> = if msg[UNIQUE_ID_BYTES] == 1 {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        bytes.copy_from_slice(&msg[..UNIQUE_ID_BYTES]);
        UniqueId::from_bytes(&bytes)
            .and_then(|id| Comm::init(&id, nranks, rank, Some(device), CommConfig::from_env()))
            .map(MkComm::new)
            .map_err(NcclError::from)
    } else {
        Err(NcclError::system("rank 0 could not start mkernel's bootstrap root"))
    };
    let mut all_made: i32 = made.is_ok() as i32;
    // SAFETY: one int32 through the device buffer, reduced with ncclMin.
    unsafe {
        check("cuMemcpyHtoD", sys::cuMemcpyHtoD_v2(scratch.buf, (&all_made as *const i32).cast(), 4))?;
        let rc = real::ncclAllReduce()?(
            buf,
            buf,
            1,
            2, /* ncclInt32 */
            3, /* ncclMin */
            comm,
            scratch.stream as cudaStream_t,
        );
        finish_real(rc, comm, scratch.stream, "ncclAllReduce of the attach outcome")?;
        check("cuMemcpyDtoH", sys::cuMemcpyDtoH_v2((&mut all_made as *mut i32).cast(), scratch.buf, 4))?;
    }
    drop(scratch);
    match (made, all_made) {
        (Ok(c), 1) => Ok(c),
        (Ok(c), _) => {
            c.abort();
            Err(NcclError::system("another rank could not create its mkernel communicator"))
        }
        (Err(e), _) => Err(NcclError::new(e.code, format!("no mkernel communicator: {}", e.message))),
    }
}

fn real_ok(rc: ncclResult_t, what: &str) -> Result<()> {
    if rc == ncclSuccess {
        Ok(())
    } else {
        Err(NcclError::new(rc, format!("the real {what} failed with ncclResult_t {rc}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn initializer() -> ncclConfig_t {
        ncclConfig_t {
            size: std::mem::size_of::<ncclConfig_t>(),
            magic: NCCL_CONFIG_MAGIC,
            version: NCCL_VERSION_CODE as u32,
            blocking: NCCL_CONFIG_UNDEF_INT,
            cgaClusterSize: NCCL_CONFIG_UNDEF_INT,
            minCTAs: NCCL_CONFIG_UNDEF_INT,
            maxCTAs: NCCL_CONFIG_UNDEF_INT,
            netName: std::ptr::null(),
            splitShare: NCCL_CONFIG_UNDEF_INT,
            trafficClass: NCCL_CONFIG_UNDEF_INT,
            commName: std::ptr::null(),
            collnetEnable: NCCL_CONFIG_UNDEF_INT,
            CTAPolicy: NCCL_CONFIG_UNDEF_INT,
            shrinkShare: NCCL_CONFIG_UNDEF_INT,
            nvlsCTAs: NCCL_CONFIG_UNDEF_INT,
            nChannelsPerNetPeer: NCCL_CONFIG_UNDEF_INT,
            nvlinkCentricSched: NCCL_CONFIG_UNDEF_INT,
        }
    }

    #[test]
    fn configs_are_read_as_nccl_reads_them() {
        let default = ParsedConfig { blocking: true, max_ctas: None };
        assert_eq!(unsafe { parse_config(std::ptr::null()) }.unwrap(), default);
        assert_eq!(unsafe { parse_config(&initializer()) }.unwrap(), default);
        let mut c = initializer();
        c.blocking = 0;
        c.maxCTAs = 16;
        assert_eq!(unsafe { parse_config(&c) }.unwrap(), ParsedConfig { blocking: false, max_ctas: Some(16) });
        c.blocking = 2;
        assert!(unsafe { parse_config(&c) }.unwrap_err().message.contains("must be 0 or 1"));
        let mut c = initializer();
        c.maxCTAs = 0;
        assert!(unsafe { parse_config(&c) }.is_err());
        let mut c = initializer();
        c.magic = 0;
        let e = unsafe { parse_config(&c) }.unwrap_err();
        assert_eq!(e.code, ncclInvalidArgument);
        assert!(e.message.contains("NCCL_CONFIG_INITIALIZER"));
        // An older, shorter struct: fields past its size are unset.
        let mut c = initializer();
        c.blocking = 0;
        c.size = std::mem::offset_of!(ncclConfig_t, blocking);
        assert_eq!(unsafe { parse_config(&c) }.unwrap(), default);
    }
}
