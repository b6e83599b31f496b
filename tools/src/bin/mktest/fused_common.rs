//! What the fused-op suites share: the rank launcher and per-rank frame, finishing
//! default-stream fills before a launch on a non-blocking stream, the rank threads' barrier
//! before a launch, the graph-replay check and the absent-rank check.

use crate::collectives::{
    async_error, check_stopped, config, control_comm, destroy, ffi, init_comm, last_error, longest_op_timeout, say,
    suite_timeout_ms, timed_sync, Stream, FAULT_TIMEOUT_MS,
};
use crate::outcome::Outcome;
use crate::ranks::{self, RankEnv};
use mkernel::bootstrap::root::start_root;
use mkernel::comm::Comm;
use mkernel::cuda::{self, sys, PrimaryContext};
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::mkComm_t;
use mkernel::types::mkDataType_t;
use mkernel_tools::testing::{CapturedGraph, TestBuffer};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// Test inputs are filled and outputs poisoned on the legacy default stream, which the
/// op's non-blocking stream does not wait for: finish them before the op is launched.
/// Only that stream: ranks that are threads of one process share the context, and waiting
/// for all of it would wait for a peer's op in flight, which waits for this rank's launch.
pub fn sync_default_stream() -> Result<()> {
    // SAFETY: synchronises the legacy default stream (NULL) of the current context.
    cuda::check("cuStreamSynchronize(legacy default stream)", unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) })
}

thread_local! {
    /// In a rank thread (MK_TEST_THREADS=1): the control communicator, whose host barrier
    /// `peers_ready` waits at. None in a rank process.
    static RANK_THREAD_CONTROL: RefCell<Option<Rc<Comm>>> = const { RefCell::new(None) };
}

/// Every rank calls this before it launches (or captures) the ops under test, after
/// preparing their inputs. Ranks that are threads of one process share one CUDA context, in which a call
/// that waits for the whole context — cuMemFree of a test buffer, cuCtxSynchronize, a
/// graph's instantiation or destruction — also waits for the peers' ops in flight, which
/// wait for this rank's launch: a deadlock until the ops' timeout. So in rank threads this
/// is a host barrier: no rank launches before every rank has finished the host work that
/// precedes its own launch. Rank processes (a context each) go straight on.
pub fn peers_ready() -> Result<()> {
    match RANK_THREAD_CONTROL.with(|c| c.borrow().clone()) {
        Some(control) => {
            control.bootstrap.barrier().map_err(|e| e.context("the rank threads' barrier before a launch"))
        }
        None => Ok(()),
    }
}

/// MK_TEST_SANITIZE=1 (scripts/gpu-sanitize.sh sets it): the suites run a set sized for
/// compute-sanitizer's racecheck and synccheck, which slow a kernel by orders of magnitude,
/// so that every tool finishes every suite: one element type (the kernels of the other are
/// the same template), at most two rounds of each case, and only the shapes a suite marks
/// as small. The sanitizer runs cap the grid (MK_MAX_CTAS) so small shapes still give
/// every CTA several work items, the path where a ring carries its phases across items.
pub fn sanitizer_sized() -> bool {
    std::env::var("MK_TEST_SANITIZE").is_ok_and(|v| v.trim() == "1")
}

/// The element types a suite's cases run in: both 16-bit types, or bf16 alone when
/// `sanitizer_sized`.
pub fn case_dtypes() -> &'static [mkDataType_t] {
    if sanitizer_sized() {
        &[mkDataType_t::mkBfloat16]
    } else {
        &[mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16]
    }
}

/// Rounds of a case: `full`, or at most two when `sanitizer_sized` (two, so the device-side
/// epochs still advance between calls).
pub fn case_rounds(full: u64) -> u64 {
    if sanitizer_sized() {
        full.min(2)
    } else {
        full
    }
}

/// None when every buffer's guard bands are intact, else which buffer's band was written.
/// Inputs are listed too: an op must not write them either.
pub fn guards_intact(buffers: &[(&str, &TestBuffer)]) -> Result<Option<String>> {
    for (name, b) in buffers {
        if let Some(what) = b.guards_intact()? {
            return Ok(Some(format!("{name}: {what}")));
        }
    }
    Ok(None)
}

/// Random contents for each of `buffers` (one allocation per rank), shard s from seed
/// `seed + s`, on the legacy default stream.
pub fn fill_shards(buffers: &[TestBuffer], seed: u64, scale: f32) -> Result<()> {
    for (s, b) in buffers.iter().enumerate() {
        b.randomize(seed + s as u64, scale, std::ptr::null_mut())?;
    }
    Ok(())
}

/// Every shard's values, concatenated in rank order.
pub fn download_shards(buffers: &[TestBuffer]) -> Result<Vec<u8>> {
    let mut all = Vec::new();
    for b in buffers {
        all.extend(b.download()?);
    }
    Ok(all)
}

/// One test case of a fused op: fresh inputs from a seed, one call, a check against the
/// float64 reference (ok, a line of detail).
pub trait FusedCase {
    fn label(&self) -> String;
    fn prepare(&self, seed: u64) -> Result<()>;
    /// The whole call on `stream`: every op of it, one after another.
    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t;
    fn verify(&self) -> Result<(bool, String)>;
    /// A call made of several ops (MoE: dispatch, combine; attention: forward, backward)
    /// says how many, and launches them one by one through `launch_op`, so that rank
    /// threads can meet between them (`between_ops`).
    fn ops(&self) -> usize {
        1
    }
    /// Op `i` (< `ops()`) of the call; for a one-op case the call itself.
    fn launch_op(&self, i: usize, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        debug_assert_eq!(i, 0, "a one-op case has op 0 only");
        self.launch(comm, stream)
    }
}

/// A case whose check also gives its output's bytes (to compare them across ranks).
pub trait CheckedOutput: FusedCase {
    /// (passed, detail, raw output bytes).
    fn verify_with_output(&self) -> Result<(bool, String, Vec<u8>)>;
}

/// An AllReduce case whose output every rank must hold bit for bit: its check also compares
/// the output's SHA-256 across ranks over the control communicator (a collective call: every
/// rank verifies the same cases in the same order).
pub struct SameOnEveryRank<'a> {
    pub case: &'a dyn CheckedOutput,
    pub control: &'a Comm,
}

impl FusedCase for SameOnEveryRank<'_> {
    fn label(&self) -> String {
        self.case.label()
    }

    fn prepare(&self, seed: u64) -> Result<()> {
        self.case.prepare(seed)
    }

    fn launch(&self, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
        self.case.launch(comm, stream)
    }

    fn verify(&self) -> Result<(bool, String)> {
        let (mut ok, mut detail, raw) = self.case.verify_with_output()?;
        let digest = mkernel::bootstrap::crypto::sha256(&[&raw]);
        let all = self.control.bootstrap.allgather(&digest)?;
        if all.iter().any(|d| d[..] != digest[..]) {
            ok = false;
            detail.push_str(", ranks' outputs DIFFER");
        } else {
            detail.push_str(", identical on all ranks");
        }
        Ok((ok, detail))
    }
}

/// MK_TEST_OP_BARRIER=0: rank threads launch a case's ops back to back instead of meeting
/// between them (to show the stall `between_ops` prevents).
fn op_barrier() -> bool {
    !std::env::var("MK_TEST_OP_BARRIER").is_ok_and(|v| v.trim() == "0")
}

/// Launches every op of `case`'s call on `stream`, rank threads meeting between them
/// (`between_ops`): the first code other than mkSuccess, after which no op is launched but
/// the rank still meets the others (a refusal on one rank must not leave its peers waiting).
pub fn launch_call(case: &dyn FusedCase, comm: mkComm_t, stream: sys::CUstream) -> Result<mkResult_t> {
    launch_ops(case, comm, stream, between_ops)
}

/// `launch_call` without the meetings: a multi-op case's `launch` (a captured graph, a
/// caller that meets the peers itself).
pub fn launch_back_to_back(case: &dyn FusedCase, comm: mkComm_t, stream: sys::CUstream) -> mkResult_t {
    launch_ops(case, comm, stream, || Ok(())).unwrap_or_else(|e| e.code)
}

/// The ops of `case`'s call in order, `meet` between two of them; once one returns a code
/// other than mkSuccess the rest are not launched (but `meet` still runs), and that code is
/// the result.
fn launch_ops(
    case: &dyn FusedCase,
    comm: mkComm_t,
    stream: sys::CUstream,
    meet: impl Fn() -> Result<()>,
) -> Result<mkResult_t> {
    let mut code = mkResult_t::mkSuccess;
    for i in 0..case.ops() {
        if i > 0 {
            meet()?;
        }
        if code == mkResult_t::mkSuccess {
            code = case.launch_op(i, comm, stream);
        }
    }
    Ok(code)
}

/// Rank threads, between two ops of one call: every rank has launched the first before
/// any launches the second. Ranks sharing a context may have their streams in one of CUDA's
/// hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), which start work in the
/// order it was queued: a rank's second op queued in front of a peer's first waits there for
/// the rank's first op, which waits for the peer's, and nothing behind it starts — a stall
/// until the ops' timeout. Rank processes (own contexts) need no such meeting.
fn between_ops() -> Result<()> {
    if op_barrier() {
        peers_ready()
    } else {
        Ok(())
    }
}

/// Runs `case` `rounds` times with fresh inputs (seeds `seed`, `seed + 1`, …): one call, a
/// bounded wait, no asynchronous error, the case's check. `before(round)` adjusts the case
/// before each round. Returns (checks, failures); the caller counts them.
pub fn check_rounds(
    comm: mkComm_t,
    rank: usize,
    op: &str,
    case: &dyn FusedCase,
    seed: u64,
    rounds: u64,
    before: &dyn Fn(u64),
) -> Result<(usize, usize)> {
    check_rounds_of(comm, rank, op, &[case], seed, rounds, before)
}

/// `check_rounds` for several cases launched one after another on one stream in every
/// round, with one bounded wait after the last: case i of round r gets seed
/// `seed + r · cases + i`, and every case is checked.
pub fn check_rounds_of(
    comm: mkComm_t,
    rank: usize,
    op: &str,
    cases: &[&dyn FusedCase],
    seed: u64,
    rounds: u64,
    before: &dyn Fn(u64),
) -> Result<(usize, usize)> {
    let stream = Stream::for_rank()?;
    let mut failures = 0;
    let labels = cases.iter().map(|c| c.label()).collect::<Vec<_>>().join(", ");
    for round in 0..rounds {
        before(round);
        for (i, case) in cases.iter().enumerate() {
            case.prepare(seed + round * cases.len() as u64 + i as u64)?;
        }
        peers_ready()?;
        // How long the launch calls held this rank's thread: with ranks sharing a context, a
        // call that waits for the context (a first module load, a free) holds its launch
        // back while the peers' kernels wait for it; the error below says which rank it was.
        let launching = Instant::now();
        for case in cases {
            ffi(&format!("{op} {}", case.label()), launch_call(*case, comm, stream.0)?, comm)?;
        }
        let launch_ms = launching.elapsed().as_secs_f64() * 1e3;
        timed_sync(&stream, longest_op_timeout()).map_err(|e| e.context(format!("{op} {labels}")))?;
        let code = async_error(comm);
        if code != mkResult_t::mkSuccess {
            return Err(MkError::new(
                code,
                format!(
                    "{op} {labels}: asynchronous error {code:?}: {} (this rank's launch calls, with the rank \
                     threads' meetings between ops, returned {launch_ms:.1} ms after the ranks' barrier)",
                    last_error(comm)
                ),
            ));
        }
        for case in cases {
            let (ok, detail) = case.verify()?;
            if !ok {
                failures += 1;
            }
            if !ok || rank == 0 {
                say(
                    rank,
                    format!("{op} {} round {round}: {detail} -> {}", case.label(), if ok { "ok" } else { "WRONG" }),
                );
            }
        }
    }
    Ok((rounds as usize * cases.len(), failures))
}

/// Waits for `stream` within the ops' bound (`timed_sync`: a stuck op ends with the
/// communicator's timeout well before it) and requires no asynchronous error on `comm`.
pub fn sync_no_error(comm: mkComm_t, stream: &Stream, what: &str) -> Result<()> {
    timed_sync(stream, longest_op_timeout()).map_err(|e| e.context(what.to_string()))?;
    let code = async_error(comm);
    if code != mkResult_t::mkSuccess {
        return Err(MkError::new(code, format!("{what}: asynchronous error {code:?}: {}", last_error(comm))));
    }
    Ok(())
}

/// Counts a suite's `checks` toward its tally, says how many were wrong, and fails when
/// any was.
pub fn count_checks(rank: usize, op: &str, checks: usize, failures: usize) -> Result<()> {
    crate::outcome::count(checks);
    say(rank, format!("correctness: {checks} checks, {failures} wrong"));
    if failures > 0 {
        return Err(MkError::internal(format!("{op}: {failures} of {checks} checks wrong")));
    }
    Ok(())
}

/// Captures one call of `op` in a CUDA graph, then three times replays it on fresh inputs
/// and checks, and makes a direct call on fresh inputs between replays (the device-side
/// epochs must stay in step whichever way the op is launched).
pub fn graph_replay(comm: mkComm_t, rank: usize, op: &str, case: &dyn FusedCase) -> Result<()> {
    let (capture_seed, replay_seed, direct_seed) = GRAPH_REPLAY_SEEDS;
    graph_replay_of(comm, rank, op, &[Captured { case, capture_seed, replay_seed }], 0, direct_seed)
}

/// [`graph_replay`]'s seeds: the capture's, and the first of the replays' and of the direct
/// calls' (each then + 0, 1, 2).
const GRAPH_REPLAY_SEEDS: (u64, u64, u64) = (1, 100, 200);

/// Every seed [`graph_replay`] prepares its case with (a case sized by its inputs, such as
/// MoE's receive capacity, needs room for them all).
pub fn graph_replay_seeds() -> impl Iterator<Item = u64> {
    let (capture, replay, direct) = GRAPH_REPLAY_SEEDS;
    std::iter::once(capture).chain(replay..replay + REPLAYS).chain(direct..direct + REPLAYS)
}

/// How many times a captured graph is replayed.
const REPLAYS: u64 = 3;

/// One launch in a captured graph: its case, the seed of its inputs at capture and, at
/// replay r, `replay_seed + r`.
pub struct Captured<'a> {
    pub case: &'a dyn FusedCase,
    pub capture_seed: u64,
    pub replay_seed: u64,
}

/// Captures the launches of `captured` in one CUDA graph, in order, then three times
/// replays it on fresh inputs and checks every launch, and between replays calls
/// `captured[direct]` directly on fresh inputs (seed `direct_seed + r`) and checks it (the
/// device-side epochs must stay in step whichever way the ops are launched).
pub fn graph_replay_of(
    comm: mkComm_t,
    rank: usize,
    op: &str,
    captured: &[Captured],
    direct: usize,
    direct_seed: u64,
) -> Result<()> {
    let stream = Stream::for_rank()?;
    for c in captured {
        c.case.prepare(c.capture_seed)?;
    }
    // Also before the capture: no peer frees or synchronises the shared context meanwhile.
    peers_ready()?;
    let graph = CapturedGraph::capture(stream.0, |s| {
        captured
            .iter()
            .try_for_each(|c| ffi(&format!("{op} {} (captured)", c.case.label()), c.case.launch(comm, s), comm))
    })?;
    let mut failures = 0;
    for replay in 0..REPLAYS {
        for c in captured {
            c.case.prepare(c.replay_seed + replay)?;
        }
        peers_ready()?;
        graph.launch(stream.0)?;
        sync_no_error(comm, &stream, &format!("{op} graph replay {replay}"))?;
        for c in captured {
            let (ok, detail) = c.case.verify()?;
            crate::outcome::count(1);
            if !ok {
                failures += 1;
                say(rank, format!("graph replay {replay}: {} {detail} -> WRONG", c.case.label()));
            }
        }
        let case = captured[direct].case;
        case.prepare(direct_seed + replay)?;
        peers_ready()?;
        ffi(&format!("{op} {}", case.label()), case.launch(comm, stream.0), comm)?;
        stream.sync()?;
        let (ok, detail) = case.verify()?;
        crate::outcome::count(1);
        if !ok {
            failures += 1;
            say(rank, format!("call between replays: {} {detail} -> WRONG", case.label()));
        }
    }
    say(
        rank,
        format!(
            "graph capture: {} launch(es) x {REPLAYS} replays + {REPLAYS} direct calls with fresh inputs, {failures} wrong",
            captured.len()
        ),
    );
    if failures > 0 {
        return Err(MkError::internal(format!("{op} graph replay gave wrong results")));
    }
    Ok(())
}

/// The last rank never calls the op (on a communicator made from `env.ids[id_index]` with
/// a short timeout); every other rank must stop within the timeout with mkTimeout or
/// mkRemoteError, refuse new work, and at least one must report mkTimeout itself.
/// `launch(comm, stream)` prepares fresh inputs and calls the op once.
pub fn absent_rank(
    env: &RankEnv,
    control: &Comm,
    id_index: usize,
    what: &str,
    launch: impl Fn(mkComm_t, sys::CUstream) -> Result<mkResult_t>,
) -> Result<()> {
    absent_rank_with_progress(env, control, id_index, what, None, launch)
}

/// `absent_rank` for an op that keeps a progress word: a surviving rank whose timeout names
/// a wait for the absent rank must also say where the absent rank stood, in a clause
/// containing `progress` (the absent rank never called, so it had begun nothing).
pub fn absent_rank_with_progress(
    env: &RankEnv,
    control: &Comm,
    id_index: usize,
    what: &str,
    progress: Option<&str>,
    launch: impl Fn(mkComm_t, sys::CUstream) -> Result<mkResult_t>,
) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let comm = init_comm(env, &env.ids[id_index], &config(FAULT_TIMEOUT_MS, 64 << 20))?;
    let stream = Stream::new()?;
    let absent = n - 1;
    let mut outcome = Ok(());
    let mut code = mkResult_t::mkSuccess;
    // Every rank, the absent one too: a barrier counts them all.
    peers_ready()?;
    if rank != absent {
        let t = Instant::now();
        ffi(what, launch(comm, stream.0)?, comm)?;
        outcome = timed_sync(&stream, longest_op_timeout())
            .and_then(|_| check_stopped(rank, comm, t.elapsed(), what).map(|c| code = c));
        if let Some(clause) = progress.filter(|_| code == mkResult_t::mkTimeout) {
            let message = last_error(comm);
            if message.contains(&format!("waiting for rank {absent} ")) && !message.contains(clause) {
                outcome = outcome.and(Err(MkError::internal(format!(
                    "{what}: the timeout names a wait for the absent rank {absent} but not where it stood \
                     (\"{clause}\"): {message}"
                ))));
            }
        }
        crate::outcome::count(1);
    }
    let codes = control.bootstrap.allgather(&[code as i32 as u8])?;
    if rank == 0 && !codes.iter().take(absent).any(|c| c[0] as i32 == mkResult_t::mkTimeout as i32) {
        outcome = outcome.and(Err(MkError::internal("no surviving rank reported mkTimeout")));
    }
    control.bootstrap.barrier()?;
    destroy(comm)?;
    outcome
}

/// Unique ids a fused suite uses: control, main, and up to two absent-rank tests.
const IDS: usize = 4;

/// Runs a fused-op suite: as a rank (when started by `ranks::spawn` or a launcher), as the
/// only rank, or by starting MK_TEST_NRANKS rank processes of this executable.
/// `checks(comm, control, rank, nranks)` runs on the main communicator; `absent(env,
/// control)` runs with several ranks, after it.
pub fn run_suite(
    name: &str,
    checks: fn(mkComm_t, &Comm, usize, usize) -> Result<()>,
    absent: fn(&RankEnv, &Comm) -> Result<()>,
) -> Result<Outcome> {
    let env = match ranks::child_env(IDS)? {
        Some(env) => env,
        None => {
            let n = ranks::nranks_requested();
            if n > 1 && ranks::threads_requested() {
                return run_rank_threads(n, checks, absent);
            }
            if n > 1 {
                println!("  starting {n} rank processes");
                ranks::spawn(&[name.to_string()], n, IDS, Duration::from_secs(240), |_| 0)?;
                return Ok(Outcome::Spawned { nranks: n });
            }
            let ids = (0..IDS).map(|_| start_root()).collect::<Result<Vec<_>>>()?;
            RankEnv { rank: 0, nranks: 1, ids, device: 0 }
        }
    };
    run_rank(&env, false, checks, absent)?;
    Ok(Outcome::Ran)
}

/// The suite's `n` ranks as threads of this process (ranks::threads_requested), each on
/// the device a rank process would use; the first error by rank (every rank's printed),
/// else the fewest checks any rank executed.
fn run_rank_threads(
    n: usize,
    checks: fn(mkComm_t, &Comm, usize, usize) -> Result<()>,
    absent: fn(&RankEnv, &Comm) -> Result<()>,
) -> Result<Outcome> {
    println!("  running {n} ranks as threads of this process");
    let ids = (0..IDS).map(|_| start_root()).collect::<Result<Vec<_>>>()?;
    let devices = cuda::device_count()?.max(1) as usize;
    // One stream per rank for all its ops, made here back to back before any thread runs.
    // The driver spreads a context's streams over its hardware queues
    // (CUDA_DEVICE_MAX_CONNECTIONS) in the order they are made; streams made per case by
    // racing threads can share a queue, where a rank's fence and op, queued in front of a
    // peer's fence, wait for it forever (until MK_TIMEOUT_MS): docs/decisions/0083.
    let contexts = (0..devices).map(|d| PrimaryContext::retain(d as i32)).collect::<Result<Vec<_>>>()?;
    let streams = (0..n)
        .map(|rank| {
            let _g = contexts[rank % devices].enter()?;
            Stream::new()
        })
        .collect::<Result<Vec<_>>>()?;
    let outcomes: Vec<Result<usize>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..n)
            .map(|rank| {
                let env = RankEnv { rank, nranks: n, ids: ids.clone(), device: (rank % devices) as i32 };
                let stream = streams[rank].address();
                s.spawn(move || {
                    Stream::lend_to_this_thread(stream);
                    run_rank(&env, true, checks, absent).map(|_| crate::outcome::take_tally())
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|_| Err(MkError::internal("a rank thread panicked"))))
            .collect()
    });
    // Every failing rank is printed: the first one's error is often a peer's report
    // (mkRemoteError) of what a later rank saw first.
    let mut first_error = None;
    let mut fewest_checks = usize::MAX;
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Ok(checks) => fewest_checks = fewest_checks.min(checks),
            Err(e) => {
                let e = e.context(format!("rank {rank}"));
                println!("  [rank {rank}] FAILED: {}", e.message);
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(Outcome::Threads { nranks: n, fewest_checks }),
    }
}

/// One rank of a fused-op suite: its communicators, the checks, and (several ranks) the
/// absent-rank check. `thread`: the rank is a thread of this process (`peers_ready`).
fn run_rank(
    env: &RankEnv,
    thread: bool,
    checks: fn(mkComm_t, &Comm, usize, usize) -> Result<()>,
    absent: fn(&RankEnv, &Comm) -> Result<()>,
) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let ctx = PrimaryContext::retain(env.device)?;
    let _g = ctx.enter()?;
    // The control communicator: host barriers and allgathers between the checks.
    let control = Rc::new(control_comm(env)?);
    if thread {
        RANK_THREAD_CONTROL.with(|c| *c.borrow_mut() = Some(control.clone()));
    }
    let outcome = (|| {
        let comm = init_comm(env, &env.ids[1], &config(suite_timeout_ms(), 64 << 20))?;
        let outcome = checks(comm, &control, rank, n);
        control.bootstrap.barrier()?;
        destroy(comm)?;
        outcome?;
        if n > 1 {
            absent(env, &control)?;
        }
        Ok(())
    })();
    RANK_THREAD_CONTROL.with(|c| c.borrow_mut().take());
    outcome
}
