//! What the fused-op benches share when they run: their ranks, the communicator's start
//! (timed), and the measurement protocol (measure.rs) run across ranks. Their options are
//! read by fused_options.rs.

use crate::measure::{measure_interleaved, slowest_per_call, Measured, Protocol, Stats};
use crate::timing::{Events, GraphOfCalls};
use mkernel::comm::Comm;
use mkernel::cuda::sys;
use mkernel::error::{MkError, Result};

/// Waits for `stream`'s work (a live stream of the current context).
pub fn sync_stream(stream: sys::CUstream) -> Result<()> {
    // SAFETY: live stream.
    unsafe { cudarc::driver::result::stream::synchronize(stream) }
        .map_err(|e| mkernel::cuda::cuda_err("cuStreamSynchronize", e))
}

pub fn bad(what: &str) -> MkError {
    MkError::invalid_argument(format!("mkbench: bad {what}"))
}

/// A bench's body on one rank: `(rank, nranks, id, device)`, true when its checks passed.
pub type RankMain<'a> = dyn Fn(usize, usize, &mkernel::bootstrap::UniqueId, i32) -> Result<bool> + Sync + 'a;

/// How every bench with ranks starts: as a rank process spawned by a parent run (the ids
/// come through the environment), as the only rank, as `ranks` threads of this process on
/// device 0 (`threads`: `--threads`, the layout of `mkCommInitAll` with a repeated device,
/// without the start skew between MPS client processes), or as the parent spawning `ranks`
/// processes of this binary that run `mkbench <name> <args>`.
pub fn run_ranks(name: &str, args: &[String], ranks: usize, threads: bool, rank_main: &RankMain) -> Result<bool> {
    use crate::record::{self, Json};
    if let Some(env) = crate::ranks::child_env(1)? {
        record::config("ranks_as", Json::str("processes"));
        return rank_main(env.rank, env.nranks, &env.ids[0], env.device);
    }
    if ranks == 1 {
        let id = mkernel::bootstrap::root::start_root()?;
        return rank_main(0, 1, &id, 0);
    }
    if threads {
        record::config("ranks_as", Json::str("threads of one process"));
        return run_threads(ranks, rank_main);
    }
    let mut child = vec![name.to_string()];
    child.extend(args.iter().cloned());
    crate::record::parent_of_ranks();
    crate::ranks::spawn(&child, ranks, 1, std::time::Duration::from_secs(500), |_| 0)?;
    Ok(true)
}

/// The ranks as threads of this process, all on device 0; true when every rank's checks
/// passed. A rank's error ends its thread, the others then fail within the communicator's
/// timeout, and the first error (by rank) is returned.
fn run_threads(ranks: usize, rank_main: &RankMain) -> Result<bool> {
    let id = &mkernel::bootstrap::root::start_root()?;
    let outcomes: Vec<Result<bool>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..ranks).map(|r| s.spawn(move || rank_main(r, ranks, id, 0))).collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|_| Err(MkError::internal("a rank thread panicked"))))
            .collect()
    });
    let mut all_ok = true;
    for outcome in outcomes {
        all_ok &= outcome?;
    }
    Ok(all_ok)
}

/// Comm::init, its time and its workspace recorded in the run's config (`comm_init_ms`,
/// `workspace_bytes`: this rank's symmetric workspace, data and fused-op regions).
pub fn init_comm(
    id: &mkernel::bootstrap::UniqueId,
    n: usize,
    rank: usize,
    device: i32,
    cfg: mkernel::comm::CommConfig,
) -> Result<Comm> {
    use crate::record::{self, Json};
    let t = std::time::Instant::now();
    let comm = Comm::init(id, n as i32, rank as i32, Some(device), cfg)?;
    // Rank 0's (ranks that are threads of one process share the record).
    if rank == 0 {
        record::config("comm_init_ms", Json::num(t.elapsed().as_secs_f64() * 1e3));
        let bytes = comm.workspace.as_ref().map(|w| w.view.data_bytes + w.view.op_bytes);
        record::config("workspace_bytes", bytes.map_or(Json::Null, |b| Json::num(b as f64)));
    }
    Ok(comm)
}

/// How one contender of the shared protocol is timed.
#[derive(Clone, Copy)]
pub enum Timed<'a> {
    /// Direct calls, each timed by its own pair of events.
    Calls(&'a dyn Fn() -> Result<()>),
    /// Direct calls, with the second function enqueued ahead of each outside its timing
    /// (restoring an in-place call's input).
    CallsAfter(&'a dyn Fn() -> Result<()>, &'a dyn Fn() -> Result<()>),
    /// Replays of a captured graph; a sample is one replay's time divided by its calls.
    Graph(&'a GraphOfCalls),
}

/// The shared protocol (measure.rs) across ranks: every rank runs the same contenders in
/// the same interleaved blocks, a barrier before each block; `events` must hold at least
/// `p.iters` pairs. Per contender, the statistics of the slowest rank's time call by call,
/// and the slowest rank's median host time to enqueue one call. A graph of G calls gets
/// max(1, p.iters / G) replays per block and warm-up replays covering `p.warmup` calls.
pub fn measure_slowest(
    comm: &Comm,
    events: &Events,
    stream: sys::CUstream,
    p: Protocol,
    contenders: &[Timed],
) -> Result<Measured> {
    let sync = || sync_stream(stream);
    let mine = measure_interleaved(
        contenders.len(),
        p,
        |c| {
            comm.bootstrap.barrier()?;
            match contenders[c] {
                Timed::Calls(f) => (0..p.warmup).try_for_each(|_| f())?,
                Timed::CallsAfter(f, before) => (0..p.warmup).try_for_each(|_| before().and_then(|_| f()))?,
                Timed::Graph(g) => (0..p.warmup.div_ceil(g.calls).max(1)).try_for_each(|_| g.launch(stream))?,
            }
            sync()
        },
        |c, iters| {
            comm.bootstrap.barrier()?;
            match contenders[c] {
                Timed::Calls(f) => events.timed_calls(stream, iters, || Ok(()), f),
                Timed::CallsAfter(f, before) => events.timed_calls(stream, iters, before, f),
                Timed::Graph(g) => {
                    let per_call = |(gpu, host): (f64, f64)| (gpu / g.calls as f64, host / g.calls as f64);
                    let replays = (iters / g.calls).max(1);
                    Ok(events
                        .timed_calls(stream, replays, || Ok(()), || g.launch(stream))?
                        .into_iter()
                        .map(per_call)
                        .collect())
                }
            }
        },
    )?;
    let mut measured = Measured { stats: Vec::with_capacity(mine.len()), host_us: Vec::with_capacity(mine.len()) };
    for samples in &mine {
        let gpu: Vec<f64> = samples.iter().map(|s| s.0).collect();
        let host: Vec<f64> = samples.iter().map(|s| s.1).collect();
        let host_median = Stats::of(&host).ok_or_else(|| bad("host timing (no samples)"))?.median;
        let (stats, host_slowest) = slowest_across_ranks(comm, &gpu, host_median)?;
        measured.stats.push(stats);
        measured.host_us.push(host_slowest);
    }
    Ok(measured)
}

/// Across ranks: the statistics of the slowest rank's time call by call (`samples` are
/// this rank's, every rank's in the same call order), and the largest of the ranks' `value`s.
pub fn slowest_across_ranks(comm: &Comm, samples: &[f64], value: f64) -> Result<(Stats, f64)> {
    let bytes: Vec<u8> = samples.iter().chain([&value]).flat_map(|t| t.to_le_bytes()).collect();
    let all = comm.bootstrap.allgather(&bytes)?;
    let mut per_rank: Vec<Vec<f64>> = all
        .iter()
        .map(|b| b.chunks_exact(8).map(|w| f64::from_le_bytes(w.try_into().expect("8 bytes"))).collect())
        .collect();
    let largest = per_rank.iter_mut().filter_map(|r| r.pop()).fold(f64::NEG_INFINITY, f64::max);
    let stats = Stats::of(&slowest_per_call(&per_rank)).ok_or_else(|| bad("timing (no samples)"))?;
    Ok((stats, largest))
}

/// `calls` calls of each of `fs` captured into one graph each, on every rank: the graphs
/// where every rank captured every one, else why not (this rank's error, or which rank
/// failed), so that all ranks replay the same graphs or none.
pub fn capture_everywhere(
    comm: &Comm,
    stream: sys::CUstream,
    calls: usize,
    fs: &[&dyn Fn() -> Result<()>],
) -> Result<std::result::Result<Vec<GraphOfCalls>, String>> {
    let mine: std::result::Result<Vec<GraphOfCalls>, String> =
        fs.iter().map(|f| GraphOfCalls::capture(stream, calls, *f).map_err(|e| e.message)).collect();
    let verdicts = comm.bootstrap.allgather(&[u8::from(mine.is_ok())])?;
    Ok(match (mine, verdicts.iter().position(|v| v.first() != Some(&1))) {
        (Err(why), _) => Err(format!("rank {}: {why}", comm.rank)),
        (Ok(_), Some(r)) => Err(format!("rank {r} could not capture")),
        (Ok(graphs), None) => Ok(graphs),
    })
}

/// A device buffer larger than any L2 (256 MiB; the H200's L2 is 50 MB): writing it before
/// a call evicts that call's inputs, for cold-cache times.
pub struct L2Flush {
    buf: mkernel::cuda::memory::DeviceBuffer,
}

impl L2Flush {
    pub fn new() -> Result<L2Flush> {
        Ok(L2Flush { buf: mkernel::cuda::memory::DeviceBuffer::alloc(256 << 20)? })
    }

    pub fn enqueue(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: our own allocation of buf.bytes; the stream is live.
        unsafe { cudarc::driver::result::memset_d8_async(self.buf.ptr, 0x5a, self.buf.bytes, stream) }
            .map_err(|e| mkernel::cuda::cuda_err("cuMemsetD8Async", e))
    }
}

/// Cold-L2 times of `f` across ranks: `p.blocks` blocks of `p.iters` calls, each call after
/// an L2 flush (outside its timing); the slowest rank per call.
pub fn measure_cold_slowest(
    comm: &Comm,
    events: &Events,
    stream: sys::CUstream,
    p: Protocol,
    flush: &L2Flush,
    f: &dyn Fn() -> Result<()>,
) -> Result<Stats> {
    let mut mine = Vec::with_capacity(p.blocks * p.iters);
    for _ in 0..p.blocks {
        comm.bootstrap.barrier()?;
        mine.extend(events.times_us_after(stream, p.iters, || flush.enqueue(stream), f)?);
    }
    Ok(slowest_across_ranks(comm, &mine, 0.0)?.0)
}

/// One call of a fused op with a zeroed per-CTA timing buffer (room for 1024 CTAs of
/// `MK_TRACE_WORDS` u64, kernels/common/trace.cuh): the buffer's words after the call.
pub fn trace_words(comm: &Comm, stream: sys::CUstream, call: &dyn Fn(u64) -> Result<()>) -> Result<Vec<u64>> {
    use cudarc::driver::result as cu;
    use mkernel::cuda;
    use mkernel::kernel_abi::MK_TRACE_WORDS;
    const MAX_CTAS: usize = 1024;
    let bytes = MAX_CTAS * MK_TRACE_WORDS * 8;
    let mut words = vec![0u64; MAX_CTAS * MK_TRACE_WORDS];
    // SAFETY: a fresh allocation, zeroed, used by one call, read back after the stream
    // finished it, then freed.
    unsafe {
        let buf = cu::malloc_sync(bytes).map_err(|e| cuda::cuda_err("cuMemAlloc", e))?;
        let run = (|| -> Result<()> {
            cu::memset_d8_sync(buf, 0, bytes).map_err(|e| cuda::cuda_err("cuMemsetD8", e))?;
            comm.bootstrap.barrier()?;
            call(buf)?;
            cu::stream::synchronize(stream).map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))?;
            cu::memcpy_dtoh_sync(&mut words, buf).map_err(|e| cuda::cuda_err("cuMemcpyDtoH", e))
        })();
        cu::free_sync(buf).map_err(|e| cuda::cuda_err("cuMemFree", e))?;
        run?;
    }
    Ok(words)
}

/// `--trace`: one more call of a fused op with a per-CTA timing buffer
/// (kernels/common/trace.cuh); every rank prints, per role, where its CTAs spent their
/// time. `call` launches the op with the buffer's device address.
pub fn print_trace(comm: &Comm, stream: sys::CUstream, label: &str, call: &dyn Fn(u64) -> Result<()>) -> Result<()> {
    use mkernel::kernel_abi::MK_TRACE_WORDS;
    let words = trace_words(comm, stream, call)?;
    let ctas: Vec<&[u64]> = words.chunks(MK_TRACE_WORDS).filter(|w| w[0] != 0).collect();
    let first = ctas.iter().map(|w| w[0]).min().unwrap_or(0);
    let all = comm.bootstrap.allgather(&first.to_le_bytes())?;
    let earliest = all.iter().map(|v| u64::from_le_bytes(v[..8].try_into().expect("8 bytes"))).min().unwrap_or(first);
    let last = ctas.iter().map(|w| w[3]).max().unwrap_or(first);
    let latest_start = ctas.iter().map(|w| w[0]).max().unwrap_or(first);
    let us = |ns: u64| ns as f64 / 1e3;
    let med_max = |mut v: Vec<u64>| -> (f64, f64) {
        v.sort_unstable();
        if v.is_empty() {
            (0.0, 0.0)
        } else {
            (us(v[v.len() / 2]), us(v[v.len() - 1]))
        }
    };
    let mut line = format!(
        "trace {label} rank {}: kernel {:.1} µs, started {:.1} µs after the earliest rank, CTA starts spread over {:.1} µs",
        comm.rank,
        us(last.saturating_sub(first)),
        us(first - earliest),
        us(latest_start - first)
    );
    for (role, name) in [(0u64, "compute"), (1, "comm")] {
        let r: Vec<&&[u64]> = ctas.iter().filter(|w| w[7] >> 32 == role).collect();
        if r.is_empty() {
            continue;
        }
        let (setup, _) = med_max(r.iter().map(|w| w[1].saturating_sub(w[0])).collect());
        let (work, work_max) = med_max(r.iter().map(|w| w[2].saturating_sub(w[1])).collect());
        let (wait, wait_max) = med_max(r.iter().map(|w| w[4]).collect());
        let (tail, _) = med_max(r.iter().map(|w| last.saturating_sub(w[2])).collect());
        let moved: u64 = r.iter().map(|w| w[5]).sum();
        let items: u64 = r.iter().map(|w| w[6]).sum();
        let busy: Vec<u64> =
            r.iter().filter(|w| w[5] > 0).map(|w| (w[2].saturating_sub(w[1])).saturating_sub(w[4]).max(1)).collect();
        let rate = if busy.is_empty() { 0.0 } else { moved as f64 / busy.iter().sum::<u64>() as f64 };
        line += &format!(
            "\n    {name:>7}: {} CTAs, setup {setup:.1} µs, work {work:.1} (max {work_max:.1}) µs, waits {wait:.1} (max {wait_max:.1}) µs, \
             idle at the end {tail:.1} µs, {items} items",
            r.len()
        );
        if moved > 0 {
            line += &format!(", {:.1} MB moved at {rate:.1} GB/s per CTA outside waits", moved as f64 / 1e6);
        }
        // GEMM CTAs that move data after their GEMM: the split of their work.
        let after: Vec<&&&[u64]> = r.iter().filter(|w| w[8] != 0).collect();
        if !after.is_empty() {
            let (gemm, gemm_max) = med_max(after.iter().map(|w| w[8].saturating_sub(w[1])).collect());
            let (rest, rest_max) = med_max(after.iter().map(|w| w[2].saturating_sub(w[8])).collect());
            let rest_ns: u64 = after.iter().map(|w| w[2].saturating_sub(w[8])).sum();
            line += &format!(
                "\n             GEMM {gemm:.1} (max {gemm_max:.1}) µs, then {rest:.1} (max {rest_max:.1}) µs moving data ({:.1} GB/s per CTA, waits included)",
                moved as f64 / rest_ns.max(1) as f64
            );
        }
        // The setup's steps (slots 10..13), where the kernel records them: when each ended,
        // the median over the CTAs that record it and CTA 0's (the MoE dispatch's prep:
        // pass 1, column scans, offsets / CTA 0's tables, pass 2).
        let steps: Vec<&&&[u64]> = r.iter().filter(|w| w[10] != 0).collect();
        if !steps.is_empty() {
            line += "\n             setup steps done after";
            for i in 10..14 {
                let (med, _) = med_max(steps.iter().map(|w| w[i].saturating_sub(w[0])).collect());
                line += &format!(" {med:.1}");
            }
            line += " µs (median over CTAs; CTA 0:";
            for i in 10..14 {
                line += &format!(" {:.1}", us(words[i].saturating_sub(words[0])));
            }
            line += ")";
        }
        // GEMM CTAs whose idle producer warps moved data during the GEMM: when they ended.
        let side: Vec<&&&[u64]> = r.iter().filter(|w| w[9] != 0).collect();
        if !side.is_empty() {
            let (done, done_max) = med_max(side.iter().map(|w| w[9].saturating_sub(w[1])).collect());
            line += &format!("\n             side warps done after {done:.1} (max {done_max:.1}) µs of the work");
        }
    }
    println!("{line}");
    Ok(())
}
