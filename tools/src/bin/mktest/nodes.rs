//! Collectives across (emulated) nodes: MK_TEST_NRANKS rank processes on this machine,
//! grouped into nodes of MK_RANKS_PER_NODE ranks (default: two nodes), the inter-node
//! traffic through each rank's proxy over MK_NET (sockets unless set; no RDMA device on the
//! GPU machine). scripts/gpu-run.sh runs it as 4 ranks on one GPU under MPS with
//! MK_RANKS_PER_NODE=2 and MK_NET=socket.
//!
//! Per rank: every dtype × AllGather / ReduceScatter (every op) / AllReduce (every op) ×
//! awkward counts × in/out of place through the C ABI, fresh random inputs, poisoned
//! outputs, float64 (exact for integers) references; large counts through a small
//! workspace (many steps per CTA: both slot parities, grants); CUDA-graph capture and
//! replay; and, last, one emulated node killed while the others are inside an AllReduce
//! waiting for it: they must stop with mkRemoteError or mkTimeout within the timeout.
//!
//! mkAllGatherGemm across the nodes: both dtypes × awkward shapes (shards straddling row
//! blocks, N and K off the tile grid) and whole-block shards of several chunks, each twice
//! with fresh inputs, against the float64 reference, the gathered A bit for bit; graph
//! capture and replay; in the killed-node test, the survivors' mkAllGatherGemm must stop
//! with mkRemoteError or mkTimeout too.
//!
//! mkGemmReduceScatter and mkGemmAllReduce across the nodes: the gemm_reduce suite's cases
//! (both dtypes, M from 1 and odd, shards off the tile grid, AllReduce bitwise identical on
//! every rank, each twice with fresh inputs) and its graph capture and replay, then calls
//! back to back without a host sync; in the killed-node test the survivors'
//! mkGemmReduceScatter must stop with mkRemoteError or mkTimeout too.
//!
//! The fused ops of different kernels back to back without a barrier, directly and in one
//! graph (the mixed suite's sequence across nodes): each switch depends on the fence that
//! also runs between nodes.
//!
//! MK_TEST_NODES=fused runs only the fused ops' checks (and graph replay) of the
//! correctness part (the collectives' ~900 cases take most of the suite's time).
//!
//! MK_TEST_KILL=skip leaves the killed-node test out, MK_TEST_KILL=only runs nothing else
//! (run it without MPS, as the collectives suite's killed rank: under MPS a dying client
//! poisons the others' contexts).
//!

use crate::ag_gemm::Case as AgGemmCase;
use crate::collectives::{
    async_error, config, graph_replay_on, init_comm, kill_mode, longest_op_timeout, run_matrix, say, timed_sync, Case,
    KillMode, Stream, FAULT_SLACK, FAULT_TIMEOUT_MS,
};
use crate::fused_common::{self, FusedCase};
use crate::outcome::{self, Outcome};
use crate::ranks::{self, RankEnv, VICTIM_EXIT};
use mkernel::comm::{Comm, CommConfig};
use mkernel::cuda::PrimaryContext;
use mkernel::error::{mkResult_t, MkError, Result};
use mkernel::ffi::config::mkConfig_t;
use mkernel::ops::collectives::CollectiveKind;
use mkernel::types::{mkDataType_t, mkRedOp_t};
use std::time::{Duration, Instant};

const IDS: usize = 6; // control, main + graph, killed node (collective), killed node (AG+GEMM), GEMM + reduction, killed node (GEMM+RS)

/// Ranks per emulated node: MK_RANKS_PER_NODE, else half the ranks (two nodes).
fn ranks_per_node(n: usize) -> usize {
    std::env::var("MK_RANKS_PER_NODE")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&r: &usize| r >= 1)
        .unwrap_or((n / 2).max(1))
}

pub fn run() -> Result<Outcome> {
    if let Some(env) = ranks::child_env(IDS)? {
        rank_main(&env)?;
        return Ok(Outcome::Ran);
    }
    let n = ranks::nranks_requested();
    let rpn = ranks_per_node(n);
    if n < 2 || n % rpn != 0 || n / rpn < 2 {
        return Ok(Outcome::Skipped(format!(
            "the nodes suite needs MK_TEST_NRANKS >= 2 split into >= 2 equal nodes (MK_TEST_NRANKS={n}, MK_RANKS_PER_NODE={rpn}); scripts/gpu-run.sh runs it with 4 ranks, 2 per node"
        )));
    }
    println!("  starting {n} rank processes, {} emulated nodes of {rpn}", n / rpn);
    let victim = kill_mode() != KillMode::Skip;
    // The killed node is the last one.
    ranks::spawn(&["nodes".to_string()], n, IDS, Duration::from_secs(240), |r| {
        if victim && r >= n - rpn {
            VICTIM_EXIT
        } else {
            0
        }
    })?;
    Ok(Outcome::Spawned { nranks: n })
}

fn node_config(timeout_ms: i32, workspace: i64, rpn: usize) -> mkConfig_t {
    let mut c = config(timeout_ms, workspace);
    c.ranksPerNode = rpn as i32;
    c
}

fn rank_main(env: &RankEnv) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let rpn = ranks_per_node(n);
    let ctx = PrimaryContext::retain(env.device)?;
    let _g = ctx.enter()?;
    // The control communicator spans one node (no proxy): host barriers between the tests.
    let mut control_cfg = CommConfig::from_env();
    control_cfg.workspace_bytes = 0;
    control_cfg.ranks_per_node = None;
    let control = Comm::init(&env.ids[0], n as i32, rank as i32, Some(env.device), control_cfg)?;
    let mode = kill_mode();
    let result = (|| {
        if mode != KillMode::Only {
            correctness_and_graphs(env, &control, rpn)?;
            gemm_reduce_across_nodes(env, &control, rpn)?;
        }
        if mode != KillMode::Skip {
            killed_node(env, &control, rpn)?;
        }
        Ok(())
    })();
    drop(control);
    result
}

fn correctness_and_graphs(env: &RankEnv, control: &Comm, rpn: usize) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    // A 4 MiB workspace makes the large counts pipeline through many steps per CTA.
    let comm = init_comm(env, &env.ids[1], &node_config(10_000, 4 << 20, rpn))?;
    // SAFETY: a live handle made by init_comm.
    let nodes = unsafe { (*comm).comm() }.topology.node_count;
    if rank == 0 {
        say(
            rank,
            format!(
                "{n} ranks in {nodes} nodes of {rpn}, inter-node over {:?}",
                unsafe { (*comm).comm() }.inter_node.lock().as_ref().map(|i| i.net)
            ),
        );
    }
    if nodes < 2 {
        return Err(MkError::internal(format!(
            "the communicator has {nodes} node(s): MK_RANKS_PER_NODE={rpn} did not split it"
        )));
    }
    let t = Instant::now();
    // MK_TEST_NODES=fused: the fused ops' checks only.
    let (checks, failures) = if std::env::var("MK_TEST_NODES").is_ok_and(|v| v == "fused") {
        (0, 0)
    } else {
        run_matrix(comm, rank, n, Some(rpn), 0x5eed_0000)?
    };
    outcome::count(checks);
    say(rank, format!("across nodes: {checks} checks, {failures} failed, {:.1} s", t.elapsed().as_secs_f64()));
    let fused = all_gather_gemm(comm, rank, n);
    let graphs = if checks > 0 { graph_replay_on(comm, rank, n, Some(rpn)) } else { Ok(()) };
    let fused_graphs = fused_common::graph_replay(
        comm,
        rank,
        "mkAllGatherGemm across nodes",
        &AgGemmCase::new(mkDataType_t::mkBfloat16, 256, 392, 200, n, rank)?,
    );
    // Every rank is done with the communicator before any closes its connections.
    control.bootstrap.barrier()?;
    crate::collectives::destroy(comm)?;
    if failures > 0 {
        return Err(MkError::internal(format!("{failures} of {checks} checks across nodes failed")));
    }
    fused.and(graphs).and(fused_graphs)
}

/// mkGemmReduceScatter / mkGemmAllReduce across the nodes, then the fused ops of different
/// kernels back to back, on their own communicator (the largest case keeps ~8 MiB of
/// partials, node partials and sums in the workspace).
fn gemm_reduce_across_nodes(env: &RankEnv, control: &Comm, rpn: usize) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let comm = init_comm(env, &env.ids[4], &node_config(10_000, 64 << 20, rpn))?;
    let t = Instant::now();
    let result = crate::gemm_reduce::correctness(comm, control, rank, n, true)
        .and_then(|_| crate::gemm_reduce::graph_replay(comm, rank, n, true))
        .and_then(|_| gemm_reduce_back_to_back(comm, rank, n))
        .and_then(|_| crate::mixed::across_nodes(comm, rank, n));
    say(
        rank,
        format!(
            "mkGemmReduceScatter / mkGemmAllReduce across nodes: {:.1} s, {}",
            t.elapsed().as_secs_f64(),
            if result.is_ok() { "passed" } else { "FAILED" }
        ),
    );
    control.bootstrap.barrier()?;
    crate::collectives::destroy(comm)?;
    result
}

/// Six calls of each op back to back without a host sync (the cross-call handshakes alone
/// keep them apart: a rank puts into another node's buffers only once that rank is done
/// with the previous call's), the same inputs, the last result checked.
fn gemm_reduce_back_to_back(comm: mkernel::ffi::mkComm_t, rank: usize, n: usize) -> Result<()> {
    let stream = Stream::new()?;
    for (scatter, m) in [(true, n * 256), (false, n * 256), (false, 40)] {
        let mut case = crate::gemm_reduce::Case::new(scatter, mkDataType_t::mkBfloat16, m, 520, 264, n, rank)?;
        case.node_partials = true;
        case.prepare(77)?;
        for _ in 0..6 {
            crate::collectives::ffi(&case.label(), case.launch(comm, stream.0), comm)?;
        }
        timed_sync(&stream, longest_op_timeout()).map_err(|e| e.context(format!("{} back to back", case.label())))?;
        let code = async_error(comm);
        if code != mkResult_t::mkSuccess {
            return Err(MkError::new(code, format!("{} back to back: asynchronous error {code:?}", case.label())));
        }
        let (ok, detail) = case.verify()?;
        outcome::count(1);
        if !ok || rank == 0 {
            say(
                rank,
                format!("{} 6 calls back to back: {detail} -> {}", case.label(), if ok { "ok" } else { "WRONG" }),
            );
        }
        if !ok {
            return Err(MkError::internal(format!("{} back to back: wrong result", case.label())));
        }
    }
    Ok(())
}

/// mkAllGatherGemm across the nodes (the communicator's 4 MiB workspace holds the largest
/// gathered A here, 2 MiB).
fn all_gather_gemm(comm: mkernel::ffi::mkComm_t, rank: usize, n: usize) -> Result<()> {
    let stream = Stream::new()?;
    let (mut checks, mut failures) = (0usize, 0usize);
    let mut shapes = crate::ag_gemm::shapes();
    // Whole-block shards of 4 chunks (own rows read in place, the NodeOrderRaster order).
    shapes.push((512, 1024, 512));
    let t = Instant::now();
    for dtype in [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat16] {
        for &(rows, cols, k) in &shapes {
            let case = AgGemmCase::new(dtype, rows, cols, k, n, rank)?;
            let (c, f) = fused_common::check_rounds(comm, rank, "mkAllGatherGemm", &case, 31, 2, &|round| {
                case.with_gathered.set(round == 0)
            })?;
            checks += c;
            failures += f;
        }
    }
    // Back to back without a host sync between calls (as a training step or mkbench issues
    // them), with and without gatheredA: the cross-call handshakes alone keep the calls apart.
    // The inputs stay the same across the calls, so the last result must match them.
    for with_gathered in [true, false] {
        let case = AgGemmCase::new(mkDataType_t::mkBfloat16, 512, 1024, 512, n, rank)?;
        case.with_gathered.set(with_gathered);
        case.prepare(41)?;
        for _ in 0..6 {
            crate::collectives::ffi("mkAllGatherGemm", case.launch(comm, stream.0), comm)?;
        }
        timed_sync(&stream, longest_op_timeout()).map_err(|e| e.context(format!("{} back to back", case.label())))?;
        let code = async_error(comm);
        if code != mkResult_t::mkSuccess {
            return Err(MkError::new(
                code,
                format!(
                    "mkAllGatherGemm {} back to back (gatheredA {with_gathered}): asynchronous error {code:?}",
                    case.label()
                ),
            ));
        }
        let (ok, detail) = case.verify()?;
        checks += 1;
        if !ok {
            failures += 1;
        }
        if !ok || rank == 0 {
            say(
                rank,
                format!(
                    "mkAllGatherGemm {} 6 calls back to back: {detail} -> {}",
                    case.label(),
                    if ok { "ok" } else { "WRONG" }
                ),
            );
        }
    }
    outcome::count(checks);
    say(
        rank,
        format!("mkAllGatherGemm across nodes: {checks} checks, {failures} wrong, {:.1} s", t.elapsed().as_secs_f64()),
    );
    if failures > 0 {
        return Err(MkError::internal(format!("mkAllGatherGemm across nodes: {failures} of {checks} checks wrong")));
    }
    Ok(())
}

/// The last emulated node dies while the others are inside an AllReduce, an
/// mkAllGatherGemm and an mkGemmReduceScatter (three communicators, three streams, all
/// kernels resident: the fused grids are capped at 16 CTAs) waiting for it: both must stop with mkRemoteError or
/// mkTimeout within the timeout.
fn killed_node(env: &RankEnv, control: &Comm, rpn: usize) -> Result<()> {
    let (rank, n) = (env.rank, env.nranks);
    let comm = init_comm(env, &env.ids[2], &node_config(FAULT_TIMEOUT_MS, 16 << 20, rpn))?;
    let mut fused_cfg = node_config(FAULT_TIMEOUT_MS, 16 << 20, rpn);
    fused_cfg.maxCtas = 16;
    let fused_comm = init_comm(env, &env.ids[3], &fused_cfg)?;
    let fused_case = AgGemmCase::new(mkDataType_t::mkBfloat16, 512, 1024, 1024, n, rank)?;
    fused_case.prepare(98)?;
    let rs_comm = init_comm(env, &env.ids[5], &fused_cfg)?;
    let rs_case = crate::gemm_reduce::Case::new(true, mkDataType_t::mkBfloat16, n * 256, 1024, 1024, n, rank)?;
    rs_case.prepare(97)?;
    let stream = Stream::new()?;
    let fused_stream = Stream::new()?;
    let rs_stream = Stream::new()?;
    let mut case =
        Case::new(CollectiveKind::AllReduce, mkDataType_t::mkFloat32, mkRedOp_t::mkSum, 4 << 20, false, rank, n)?;
    case.prepare(99)?;
    control.bootstrap.barrier()?;
    if rank >= n - rpn {
        // Never join the ops: the survivors are waiting for this node's data when it dies.
        std::thread::sleep(Duration::from_millis(500));
        say(
            rank,
            "killed node: exiting while the other nodes are in mkAllReduce, mkAllGatherGemm and mkGemmReduceScatter",
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
        // SAFETY: ends the process at once, as a crash would.
        unsafe { libc::_exit(VICTIM_EXIT) };
    }
    let t = Instant::now();
    case.launch(comm, stream.0)?;
    crate::collectives::ffi("mkAllGatherGemm", fused_case.launch(fused_comm, fused_stream.0), fused_comm)?;
    crate::collectives::ffi("mkGemmReduceScatter", rs_case.launch(rs_comm, rs_stream.0), rs_comm)?;
    let limit = Duration::from_millis(FAULT_TIMEOUT_MS as u64) + FAULT_SLACK;
    let elapsed = timed_sync(&stream, longest_op_timeout())?;
    let code = async_error(comm);
    say(rank, format!("killed node: stopped after {:.2} s with {code:?}", elapsed.as_secs_f64()));
    if code != mkResult_t::mkTimeout && code != mkResult_t::mkRemoteError {
        return Err(MkError::internal(format!("killed node: expected mkTimeout or mkRemoteError, got {code:?}")));
    }
    if t.elapsed() > limit {
        return Err(MkError::internal(format!(
            "killed node: took {:.2} s, more than the timeout plus {} s",
            t.elapsed().as_secs_f64(),
            FAULT_SLACK.as_secs()
        )));
    }
    // Each fused op must stop the same way, within the same limit.
    let fused_stopped = |what: &str, stream: &Stream, comm| -> Result<mkResult_t> {
        timed_sync(stream, longest_op_timeout())?;
        let code = async_error(comm);
        say(rank, format!("killed node: {what} stopped after {:.2} s with {code:?}", t.elapsed().as_secs_f64()));
        if code != mkResult_t::mkTimeout && code != mkResult_t::mkRemoteError {
            return Err(MkError::internal(format!(
                "killed node: {what}: expected mkTimeout or mkRemoteError, got {code:?}"
            )));
        }
        if t.elapsed() > limit {
            return Err(MkError::internal(format!(
                "killed node: {what} took {:.2} s, more than the timeout plus {} s",
                t.elapsed().as_secs_f64(),
                FAULT_SLACK.as_secs()
            )));
        }
        Ok(code)
    };
    let fused_code = fused_stopped("mkAllGatherGemm", &fused_stream, fused_comm)?;
    fused_stopped("mkGemmReduceScatter", &rs_stream, rs_comm)?;
    outcome::count(3);
    // The communicators refuse new work with the same code.
    let again = case.launch(comm, stream.0).err().map(|e| e.code);
    if again != Some(code) {
        return Err(MkError::internal(format!(
            "killed node: a new op after the failure gave {again:?}, expected {code:?}"
        )));
    }
    let again = fused_case.launch(fused_comm, fused_stream.0);
    if again != fused_code {
        return Err(MkError::internal(format!(
            "killed node: mkAllGatherGemm after the failure gave {again:?}, expected {fused_code:?}"
        )));
    }
    crate::collectives::destroy(comm)?;
    crate::collectives::destroy(fused_comm)?;
    crate::collectives::destroy(rs_comm)?;
    Ok(())
}
