//! Two ranks of one CUDA context (mkCommInitAll on one device) whose streams share one
//! hardware queue. CUDA spreads a context's streams over CUDA_DEVICE_MAX_CONNECTIONS queues
//! and a queue starts its kernels in order, so with one queue rank 1's kernel starts only
//! after rank 0's has ended, while rank 0's waits for rank 1's: the two ranks cannot both
//! run. No hang: rank 0's wait gives up at the communicator's timeout (mkTimeout) and raises
//! the abort word, rank 1's kernel then starts and stops at its first wait (mkRemoteError),
//! both streams are done within the timeout plus the slack, and each communicator refuses
//! its next call with its error. The same can happen with any number of queues when two
//! ranks' streams land in the same one (docs/thread-safety.md).
//!
//! The driver reads CUDA_DEVICE_MAX_CONNECTIONS when it creates the context, so the suite
//! runs the check in a child process of its own, with one queue and a short timeout.

use crate::collectives::{check_stopped, destroy, ffi, timed_sync, Case, Stream, FAULT_TIMEOUT_MS};
use crate::outcome::{self, Outcome};
use mkernel::cuda::PrimaryContext;
use mkernel::error::{MkError, Result};
use mkernel::ffi::comm::mkCommInitAll;
use mkernel::ffi::mkComm_t;
use mkernel::ops::collectives::CollectiveKind;
use mkernel::types::{mkDataType_t, mkRedOp_t};
use std::process::Command;
use std::time::{Duration, Instant};

/// Set in the child process that runs the check.
const CHILD: &str = "MK_TEST_SHARED_QUEUE_CHILD";

pub fn run() -> Result<Outcome> {
    if std::env::var_os(CHILD).is_some() {
        child()?;
        return Ok(Outcome::Ran);
    }
    let exe = std::env::current_exe().map_err(|e| MkError::internal(format!("mktest's own path: {e}")))?;
    let mut child = Command::new(exe)
        .arg("shared_queue")
        .env(CHILD, "1")
        .env("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        .env("MK_TIMEOUT_MS", FAULT_TIMEOUT_MS.to_string())
        .spawn()
        .map_err(|e| MkError::internal(format!("starting the shared-queue child: {e}")))?;
    // The child bounds its own waits; this bound only keeps a broken child from hanging the run.
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(MkError::timeout("the shared-queue child did not end within 120 s"));
            }
            Err(e) => return Err(MkError::internal(format!("waiting for the shared-queue child: {e}"))),
        }
    };
    if !status.success() {
        return Err(MkError::internal(format!("the shared-queue child failed ({status})")));
    }
    // The child's two checks (one per rank), counted here where the floor is judged.
    outcome::count(2);
    Ok(Outcome::Ran)
}

fn child() -> Result<()> {
    let mut comms: [mkComm_t; 2] = [std::ptr::null_mut(); 2];
    let devs = [0i32, 0];
    // SAFETY: room for two handles and two device ordinals.
    ffi("mkCommInitAll", unsafe { mkCommInitAll(comms.as_mut_ptr(), 2, devs.as_ptr()) }, std::ptr::null_mut())?;
    let ctx = PrimaryContext::retain(0)?;
    let _g = ctx.enter()?;
    let streams = [Stream::new()?, Stream::new()?];
    let kind = (CollectiveKind::AllReduce, mkDataType_t::mkFloat32, mkRedOp_t::mkSum, 1usize << 20);
    let mut cases = [
        Case::new(kind.0, kind.1, kind.2, kind.3, false, 0, 2)?,
        Case::new(kind.0, kind.1, kind.2, kind.3, false, 1, 2)?,
    ];
    for c in cases.iter_mut() {
        c.prepare(4343)?;
    }
    let start = Instant::now();
    // Rank 0 first, so its kernel holds the queue while it waits for rank 1's.
    for (rank, c) in cases.iter().enumerate() {
        c.launch(comms[rank], streams[rank].0)?;
        std::thread::sleep(Duration::from_millis(50));
    }
    // Bounded by the communicators' timeout plus timed_sync's margin; check_stopped then
    // holds the stop to the timeout plus FAULT_SLACK.
    for s in &streams {
        timed_sync(s, Duration::from_millis(FAULT_TIMEOUT_MS as u64))?;
    }
    let elapsed = start.elapsed();
    for (rank, &comm) in comms.iter().enumerate() {
        check_stopped(rank, comm, elapsed, "two ranks' streams in one hardware queue")?;
    }
    for c in comms {
        destroy(c)?;
    }
    Ok(())
}
