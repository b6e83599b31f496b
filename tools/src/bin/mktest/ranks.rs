//! The multi-rank harness: `mktest <suite>` with MK_TEST_NRANKS=N > 1 starts N rank
//! processes of itself (one GPU per rank where there are several, else all on device 0 —
//! run them under MPS so their persistent kernels are co-resident), hands them the unique
//! ids through MK_TEST_IDS, and waits for them with a deadline, killing stragglers.
//!
//! With MK_TEST_THREADS=1 the fused-op suites run their ranks as threads of this process
//! instead (`threads_requested`).
//!
//! A launcher (mpirun, srun, a script) can start the ranks itself instead: set
//! MK_TEST_RANK, MK_TEST_NRANKS and MK_TEST_ID_FILE (a path on a shared file system) in
//! every rank; rank 0 creates the ids and writes them there, the others read them.

use mkernel::bootstrap::{root::start_root, UniqueId, UNIQUE_ID_BYTES};
use mkernel::error::MkError;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub const ENV_RANK: &str = "MK_TEST_RANK";
pub const ENV_NRANKS: &str = "MK_TEST_NRANKS";
pub const ENV_IDS: &str = "MK_TEST_IDS";
pub const ENV_ID_FILE: &str = "MK_TEST_ID_FILE";
/// Exit status of a rank that a test kills on purpose.
pub const VICTIM_EXIT: i32 = 42;
/// Exit status of a run (or a rank process) in which nothing failed but something did not
/// run: the automake/ctest convention for a skipped test.
pub const SKIP_EXIT: i32 = 77;

pub struct RankEnv {
    pub rank: usize,
    pub nranks: usize,
    pub ids: Vec<UniqueId>,
    pub device: i32,
}

pub const ENV_THREADS: &str = "MK_TEST_THREADS";

/// Whether the ranks run as threads of one process (MK_TEST_THREADS=1), every
/// communicator in the one context of its device, as `mkCommInitAll` makes them (peers
/// reached by plain pointers, no IPC), instead of rank processes. The suites with a
/// killed rank or node, which need processes, ignore it.
pub fn threads_requested() -> bool {
    std::env::var(ENV_THREADS).is_ok_and(|v| v.trim() == "1")
}

/// Ranks asked for (MK_TEST_NRANKS, default 1).
pub fn nranks_requested() -> usize {
    std::env::var(ENV_NRANKS).ok().and_then(|v| v.trim().parse().ok()).filter(|&n| n >= 1).unwrap_or(1)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_ids(s: &str) -> mkernel::Result<Vec<UniqueId>> {
    s.trim()
        .split(',')
        .map(|h| {
            let h = h.trim();
            if h.len() != 2 * UNIQUE_ID_BYTES {
                return Err(MkError::invalid_argument(format!(
                    "{ENV_IDS}: an id has {} hex digits, expected {}",
                    h.len(),
                    2 * UNIQUE_ID_BYTES
                )));
            }
            let mut b = [0u8; UNIQUE_ID_BYTES];
            for (i, byte) in b.iter_mut().enumerate() {
                *byte = u8::from_str_radix(&h[2 * i..2 * i + 2], 16)
                    .map_err(|_| MkError::invalid_argument(format!("{ENV_IDS}: not hex")))?;
            }
            UniqueId::from_bytes(&b)
        })
        .collect()
}

fn make_ids(n: usize) -> mkernel::Result<(Vec<UniqueId>, String)> {
    let ids: Vec<UniqueId> = (0..n).map(|_| start_root()).collect::<mkernel::Result<_>>()?;
    let text = ids.iter().map(|id| hex(&id.to_bytes())).collect::<Vec<_>>().join(",");
    Ok((ids, text))
}

/// This process's rank when it is one of several (started by `spawn` or a launcher).
pub fn child_env(nids: usize) -> mkernel::Result<Option<RankEnv>> {
    let Some(rank) = std::env::var(ENV_RANK).ok().and_then(|v| v.trim().parse::<usize>().ok()) else { return Ok(None) };
    let nranks = nranks_requested();
    let ids = if let Ok(s) = std::env::var(ENV_IDS) {
        parse_ids(&s)?
    } else if let Ok(path) = std::env::var(ENV_ID_FILE) {
        if rank == 0 {
            let (ids, text) = make_ids(nids)?;
            let tmp = format!("{path}.tmp{}", std::process::id());
            std::fs::write(&tmp, &text)
                .and_then(|_| std::fs::rename(&tmp, &path))
                .map_err(|e| MkError::system(format!("writing {path}: {e}")))?;
            ids
        } else {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                if let Ok(s) = std::fs::read_to_string(&path) {
                    break parse_ids(&s)?;
                }
                if Instant::now() > deadline {
                    return Err(MkError::timeout(format!("rank {rank}: {path} did not appear within 60 s")));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    } else {
        return Err(MkError::invalid_argument(format!("{ENV_RANK} is set but neither {ENV_IDS} nor {ENV_ID_FILE} is")));
    };
    if ids.len() < nids {
        return Err(MkError::invalid_argument(format!("{} unique ids given, the suite needs {nids}", ids.len())));
    }
    if rank >= nranks {
        return Err(MkError::invalid_argument(format!("{ENV_RANK}={rank} is not below {ENV_NRANKS}={nranks}")));
    }
    let devices = mkernel::cuda::device_count()?.max(1) as usize;
    Ok(Some(RankEnv { rank, nranks, ids, device: (rank % devices) as i32 }))
}

/// Runs this executable with `args` in `nranks` processes of this executable; each rank must exit with
/// `expected_exit(rank)` before `deadline`, or every remaining rank is killed. A rank that
/// exits with `SKIP_EXIT` (it could not run) is a failure, reported as a skip.
pub fn spawn(
    args: &[String],
    nranks: usize,
    nids: usize,
    deadline: Duration,
    expected_exit: impl Fn(usize) -> i32,
) -> mkernel::Result<()> {
    spawn_with_env(args, nranks, nids, deadline, &[], expected_exit)
}

/// `spawn`, with `env` (name, value) set in every rank process besides the rank variables.
pub fn spawn_with_env(
    args: &[String],
    nranks: usize,
    nids: usize,
    deadline: Duration,
    env: &[(&str, String)],
    expected_exit: impl Fn(usize) -> i32,
) -> mkernel::Result<()> {
    let (_ids, text) = make_ids(nids)?;
    let exe = std::env::current_exe().map_err(|e| MkError::system(format!("current_exe: {e}")))?;
    let mut children: Vec<Option<Child>> = Vec::new();
    for r in 0..nranks {
        let child = Command::new(&exe)
            .args(args)
            .env(ENV_RANK, r.to_string())
            .env(ENV_NRANKS, nranks.to_string())
            .env(ENV_IDS, &text)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .spawn()
            .map_err(|e| MkError::system(format!("starting rank {r}: {e}")))?;
        children.push(Some(child));
    }
    let start = Instant::now();
    let mut failures = Vec::new();
    let mut remaining = nranks;
    while remaining > 0 {
        for (r, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot.as_mut() else { continue };
            if let Ok(Some(status)) = child.try_wait() {
                let code = status.code().unwrap_or(-1);
                if code == SKIP_EXIT && expected_exit(r) != SKIP_EXIT {
                    failures.push(format!(
                        "rank {r} SKIPPED (exit {SKIP_EXIT}): a rank that cannot run fails the multi-rank case"
                    ));
                } else if code != expected_exit(r) {
                    failures.push(format!("rank {r} exited with {status} (expected {})", expected_exit(r)));
                }
                *slot = None;
                remaining -= 1;
            }
        }
        if remaining > 0 && start.elapsed() > deadline {
            for (r, slot) in children.iter_mut().enumerate() {
                if let Some(child) = slot.as_mut() {
                    let _ = child.kill();
                    let _ = child.wait();
                    failures.push(format!("rank {r} did not finish within {} s and was killed", deadline.as_secs()));
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(MkError::internal(failures.join("; ")))
    }
}
