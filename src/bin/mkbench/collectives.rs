//! `mkbench all_gather | reduce_scatter | all_reduce`, in the style of nccl-tests:
//!
//!   mkbench all_gather -b 8 -e 1G -f 2 -n 20 -w 5 -g <ranks> [--op sum|avg] [--json PATH]
//!
//! With -g N > 1 it starts N rank processes of itself (sharing the GPU under MPS, or one
//! per GPU), or joins ranks a launcher started (MK_TEST_RANK / MK_TEST_NRANKS /
//! MK_TEST_ID_FILE, as mktest). Sizes are bytes of the larger buffer (nccl-tests'
//! convention: AllGather's recvbuff, ReduceScatter's sendbuff, AllReduce's buffer), float32.
//! Per size: -w warm-up calls, then -n calls each timed with CUDA events; the median is
//! reported (the slowest rank's median). algbw = size / time; busbw = algbw × (n−1)/n
//! (AllGather, ReduceScatter) or × 2(n−1)/n (AllReduce). #wrong is counted on the device
//! against the inputs' generator. The baseline in the same run: a device-to-device
//! cuMemcpyAsync of the same size (read + write, as our one-rank copy), timed the same way
//! while the other ranks wait; and NCCL (dlopen, src/bin/mkbench/nccl.rs) out of place on the
//! same buffers when the ranks sit on several GPUs (NCCL refuses two ranks on one GPU).

use crate::nccl::Nccl;
use crate::ranks;

use cudarc::driver::result as cu;
use mkernel::comm::CommConfig;
use mkernel::cuda::{self, sys, LaunchConfig, PrimaryContext};
use mkernel::error::{MkError, Result};
use mkernel::kernel_abi::CollectiveCheckParams;
use mkernel::ops::collectives::{collective, CollectiveKind};
use mkernel::ops::util::fill_random;
use mkernel::testing::TestBuffer;
use mkernel::types::{mkDataType_t, mkRedOp_t};
use std::time::Duration;

struct Options {
    kind: CollectiveKind,
    min_bytes: u64,
    max_bytes: u64,
    factor: u64,
    iters: usize,
    warmup: usize,
    ranks: usize,
    op: mkRedOp_t,
}

fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1u64 << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().ok().map(|v| v * mul)
}

fn parse(op_name: &str, args: &[String]) -> Result<Options> {
    let kind = match op_name {
        "all_gather" => CollectiveKind::AllGather,
        "reduce_scatter" => CollectiveKind::ReduceScatter,
        "all_reduce" => CollectiveKind::AllReduce,
        _ => return Err(MkError::invalid_argument(format!("unknown collective {op_name}"))),
    };
    let mut o = Options {
        kind,
        min_bytes: 8,
        max_bytes: 1 << 30,
        factor: 2,
        iters: 20,
        warmup: 5,
        ranks: 1,
        op: mkRedOp_t::mkSum,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or_else(|| MkError::invalid_argument(format!("{a} needs a value")));
        let bad = |a: &str| MkError::invalid_argument(format!("bad value for {a}"));
        match a.as_str() {
            "-b" => o.min_bytes = parse_size(&val()?).ok_or_else(|| bad("-b"))?,
            "-e" => o.max_bytes = parse_size(&val()?).ok_or_else(|| bad("-e"))?,
            "-f" => o.factor = val()?.parse().map_err(|_| bad("-f"))?,
            "-n" => o.iters = val()?.parse().map_err(|_| bad("-n"))?,
            "-w" => o.warmup = val()?.parse().map_err(|_| bad("-w"))?,
            "-g" => o.ranks = val()?.parse().map_err(|_| bad("-g"))?,
            "--op" => {
                o.op = match val()?.as_str() {
                    "sum" => mkRedOp_t::mkSum,
                    "avg" => mkRedOp_t::mkAvg,
                    _ => return Err(bad("--op (sum or avg)")),
                }
            }
            other => {
                return Err(MkError::invalid_argument(format!(
                    "unknown option {other:?} (see src/bin/mkbench/collectives.rs)"
                )))
            }
        }
    }
    if o.factor < 2 || o.iters == 0 || o.ranks == 0 || o.min_bytes == 0 || o.min_bytes > o.max_bytes {
        return Err(MkError::invalid_argument("need -f >= 2, -n >= 1, -g >= 1 and 0 < -b <= -e"));
    }
    Ok(o)
}

/// Parses the options without touching a GPU.
pub fn check(op_name: &str, args: &[String]) -> Result<()> {
    parse(op_name, args).map(|_| ())
}

pub fn all_gather(args: &[String]) -> Result<bool> {
    run("all_gather", args)
}
pub fn reduce_scatter(args: &[String]) -> Result<bool> {
    run("reduce_scatter", args)
}
pub fn all_reduce(args: &[String]) -> Result<bool> {
    run("all_reduce", args)
}

fn run(op_name: &str, args: &[String]) -> Result<bool> {
    let o = parse(op_name, args)?;
    if let Some(env) = ranks::child_env(1)? {
        return rank_main(&o, env.rank, env.nranks, &env.ids[0], env.device);
    }
    if o.ranks == 1 {
        let id = mkernel::bootstrap::root::start_root()?;
        return rank_main(&o, 0, 1, &id, 0);
    }
    let mut child_args = vec![op_name.to_string()];
    child_args.extend(args.iter().cloned());
    crate::record::parent_of_ranks();
    ranks::spawn(&child_args, o.ranks, 1, Duration::from_secs(95), |_| 0)?;
    Ok(true)
}

pub(crate) struct Events {
    pairs: Vec<(sys::CUevent, sys::CUevent)>,
}
impl Events {
    pub(crate) fn new(n: usize) -> Result<Self> {
        let mk =
            || cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| cuda::cuda_err("cuEventCreate", e));
        Ok(Events { pairs: (0..n).map(|_| Ok((mk()?, mk()?))).collect::<Result<_>>()? })
    }
    /// Median microseconds of `f` over the pairs, each call timed on its own.
    pub(crate) fn median_us(&self, stream: sys::CUstream, f: impl FnMut() -> Result<()>) -> Result<f64> {
        let mut times = self.times_us(stream, self.pairs.len(), f)?;
        times.sort_by(|a, b| a.total_cmp(b));
        Ok(times[times.len() / 2])
    }

    /// Microseconds of each of `calls` calls of `f` (at most one per event pair), each
    /// call timed on its own, in call order.
    pub(crate) fn times_us(
        &self,
        stream: sys::CUstream,
        calls: usize,
        f: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        self.times_us_after(stream, calls, || Ok(()), f)
    }

    /// As `times_us`, with `before()` enqueued ahead of each call, outside its timing (an
    /// L2 flush for cold-cache times).
    pub(crate) fn times_us_after(
        &self,
        stream: sys::CUstream,
        calls: usize,
        mut before: impl FnMut() -> Result<()>,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        let pairs = &self.pairs[..calls.min(self.pairs.len())];
        let mut times = Vec::with_capacity(pairs.len());
        // SAFETY: live events and stream.
        unsafe {
            for &(a, b) in pairs {
                before()?;
                cu::event::record(a, stream).map_err(|e| cuda::cuda_err("cuEventRecord", e))?;
                f()?;
                cu::event::record(b, stream).map_err(|e| cuda::cuda_err("cuEventRecord", e))?;
            }
            for &(a, b) in pairs {
                cu::event::synchronize(b).map_err(|e| cuda::cuda_err("cuEventSynchronize", e))?;
                times.push(cu::event::elapsed(a, b).map_err(|e| cuda::cuda_err("cuEventElapsedTime", e))? as f64 * 1e3);
            }
        }
        Ok(times)
    }
}

struct Row {
    bytes: u64,
    count: u64,
    times: [f64; 2],
    wrong: [u64; 2],
    copy_us: f64,
    nccl_us: Option<f64>,
    /// Host µs to enqueue one out-of-place call (this rank's, rank 0 reports).
    host_us: f64,
}

fn rank_main(o: &Options, rank: usize, n: usize, id: &mkernel::bootstrap::UniqueId, device: i32) -> Result<bool> {
    let ctx = PrimaryContext::retain(device)?;
    let _g = ctx.enter()?;
    let comm = crate::fused_common::init_comm(id, n, rank, device, CommConfig::from_env())?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let dtype = mkDataType_t::mkFloat32;
    let es = 4u64;
    let nr = n as u64;
    let kind = o.kind;
    // count per rank segment for a size: the larger buffer holds size bytes
    let count_of = |bytes: u64| match kind {
        CollectiveKind::AllReduce => bytes / es,
        _ => bytes / es / nr,
    };
    let (send_max, recv_max) = kind.buffer_counts(count_of(o.max_bytes), nr).unwrap();
    let send = TestBuffer::new(send_max as usize, dtype)?;
    let recv = TestBuffer::new(recv_max as usize, dtype)?;
    let (copy_src, copy_dst) = if rank == 0 {
        (
            Some(TestBuffer::new((o.max_bytes / es) as usize, dtype)?),
            Some(TestBuffer::new((o.max_bytes / es) as usize, dtype)?),
        )
    } else {
        (None, None)
    };
    if let Some(src) = &copy_src {
        src.randomize(7, 1.0, stream)?;
    }
    let wrong_counter = TestBuffer::new(1, mkDataType_t::mkUint64)?;
    let check_fn = mkernel::cuda::kernels::MK_COLLECTIVE_CHECK.function()?;
    let events = Events::new(o.iters)?;
    let seed_base = 1000u64;
    let factor = match kind {
        CollectiveKind::AllReduce => 2.0 * (nr as f64 - 1.0) / nr as f64,
        _ => (nr as f64 - 1.0) / nr as f64,
    };
    let sync = || -> Result<()> {
        // SAFETY: live stream.
        unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))
    };

    let gpus = cuda::device_count()?;
    let mut nccl_note = if gpus > 1 {
        String::new()
    } else {
        "needs several GPUs; this machine shows one, so only the D2D copy baseline runs".to_string()
    };
    let nccl = if n > 1 && gpus > 1 {
        match Nccl::init(&comm.bootstrap, rank, n) {
            Ok(x) => {
                nccl_note = "NCCL (dlopen), out of place on the same buffers, NCCL_NVLS_ENABLE=0".into();
                Some(x)
            }
            Err(e) => {
                nccl_note = format!("not available: {}", e.message);
                None
            }
        }
    } else {
        if n == 1 && gpus > 1 {
            nccl_note = "one rank: nothing to compare".into();
        }
        None
    };
    if rank == 0 {
        let sms = cuda::sm_count(device)?;
        println!("# mkbench {}: {n} rank(s), float32, op {:?}, {} SMs, MK_MAX_CTAS={}, warm-up {} + {} timed calls (median of the slowest rank)",
            kind.name(), o.op, sms, comm.config.max_ctas.map_or("-".into(), |v| v.to_string()), o.warmup, o.iters);
        println!("# NCCL baseline: {nccl_note}");
        if comm.topology.spans_nodes() {
            let net = comm.inter_node.lock().as_ref().map(|i| format!("{:?}", i.net)).unwrap_or_default();
            println!("# across {} nodes of {} ranks (hierarchical kernel), inter-node over {net}: network GB/s per rank = algbw x {:.3}",
                comm.topology.node_count, comm.topology.local_size(),
                mkernel::ops::hier_collectives::network_fraction(kind, comm.topology.node_count as u64, nr));
        }
        println!("#");
        println!(
            "# {:>12} {:>12} {:>6}   {:>10} {:>8} {:>8} {:>6}   {:>10} {:>8} {:>8} {:>6}   {:>10} {:>8} {:>7}",
            "", "", "", "out-of-place", "", "", "", "in-place", "", "", "", "D2D copy", "", ""
        );
        println!("# {:>12} {:>12} {:>6}   {:>10} {:>8} {:>8} {:>6}   {:>10} {:>8} {:>8} {:>6}   {:>10} {:>8} {:>7}   {:>10} {:>8} {:>7}",
            "size(B)", "count", "type", "time(us)", "algbw", "busbw", "#wrong", "time(us)", "algbw", "busbw", "#wrong", "time(us)", "GB/s", "oop/copy", "nccl(us)", "busbw", "bw/nccl");
    }
    let mut rows = Vec::new();
    let mut all_ok = true;
    let mut bytes = o.min_bytes;
    while bytes <= o.max_bytes {
        let count = count_of(bytes);
        if count == 0 {
            bytes *= o.factor;
            continue;
        }
        let size = match kind {
            CollectiveKind::AllReduce => count * es,
            _ => count * es * nr,
        };
        let mut row =
            Row { bytes: size, count, times: [0.0; 2], wrong: [0; 2], copy_us: 0.0, nccl_us: None, host_us: 0.0 };
        // Baseline first, alone on the GPU.
        comm.bootstrap.barrier()?;
        if let (Some(src), Some(dst)) = (&copy_src, &copy_dst) {
            let copy = || -> Result<()> {
                // SAFETY: both buffers hold max_bytes >= size.
                unsafe { cu::memcpy_dtod_async(dst.ptr(), src.ptr(), size as usize, stream) }
                    .map_err(|e| cuda::cuda_err("cuMemcpyDtoDAsync", e))
            };
            for _ in 0..o.warmup {
                copy()?;
            }
            row.copy_us = events.median_us(stream, copy)?;
        }
        comm.bootstrap.barrier()?;
        for (slot, in_place) in [false, true].into_iter().enumerate() {
            let (send_n, _recv_n) = kind.buffer_counts(count, nr).unwrap();
            let (sp, rp) = if in_place {
                match kind {
                    CollectiveKind::AllGather => (recv.ptr() + rank as u64 * count * es, recv.ptr()),
                    CollectiveKind::ReduceScatter => (recv.ptr(), recv.ptr() + rank as u64 * count * es),
                    CollectiveKind::AllReduce => (recv.ptr(), recv.ptr()),
                }
            } else {
                (send.ptr(), recv.ptr())
            };
            // ReduceScatter in place needs recvbuff to hold the whole send: use send for it.
            let (sp, rp) = if in_place && kind == CollectiveKind::ReduceScatter {
                (send.ptr(), send.ptr() + rank as u64 * count * es)
            } else {
                (sp, rp)
            };
            let fill = || fill_random(sp, send_n, dtype, seed_base + rank as u64, 1.0, stream);
            let call = || collective(&comm, kind, sp, rp, count as usize, dtype as i32, Some(o.op as i32), stream);
            fill()?;
            for _ in 0..o.warmup {
                call()?;
            }
            sync()?;
            comm.bootstrap.barrier()?;
            let t = events.median_us(stream, call)?;
            sync()?;
            if !in_place {
                row.host_us = crate::measure::host_enqueue_us(o.iters, call)?;
                sync()?;
                comm.bootstrap.barrier()?;
            }
            // In place the timed calls reduced their own output: refill and run once to check.
            if in_place && kind != CollectiveKind::AllGather {
                comm.bootstrap.barrier()?;
                fill()?;
                call()?;
            }
            let err = comm.async_error();
            if err != mkernel::mkResult_t::mkSuccess {
                return Err(MkError::new(err, format!("{} failed asynchronously at {size} bytes", kind.name())));
            }
            // SAFETY: one u64.
            unsafe { cu::memset_d8_async(wrong_counter.ptr(), 0, 8, stream) }
                .map_err(|e| cuda::cuda_err("cuMemsetD8Async", e))?;
            let out_count = if kind == CollectiveKind::AllGather { count * nr } else { count };
            let mut p = CollectiveCheckParams {
                out: rp,
                wrong: wrong_counter.ptr(),
                count,
                seed_base,
                kind: kind as i32,
                op: o.op as i32,
                rank: rank as i32,
                nranks: n as i32,
            };
            let cfg = LaunchConfig {
                grid: (out_count.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
                block: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: one CollectiveCheckParams; rp holds out_count floats.
            unsafe { cuda::launch(check_fn, cfg, stream, &mut [(&mut p as *mut CollectiveCheckParams).cast()])? };
            sync()?;
            let mut w = [0u8; 8];
            // SAFETY: reads the one u64.
            unsafe { cu::memcpy_dtoh_sync(&mut w, wrong_counter.ptr()) }
                .map_err(|e| cuda::cuda_err("cuMemcpyDtoH", e))?;
            let wrong = u64::from_le_bytes(w);
            // The slowest rank's median, and everyone's wrong elements.
            let mut mine = t.to_le_bytes().to_vec();
            mine.extend_from_slice(&wrong.to_le_bytes());
            let all = comm.bootstrap.allgather(&mine)?;
            row.times[slot] = all.iter().map(|b| f64::from_le_bytes(b[..8].try_into().unwrap())).fold(0.0, f64::max);
            row.wrong[slot] = all.iter().map(|b| u64::from_le_bytes(b[8..16].try_into().unwrap())).sum();
        }
        if let Some(nc) = &nccl {
            let (sp, rp) = (send.ptr(), recv.ptr());
            let ncall = || nc.call(kind as i32, sp, rp, count as usize, dtype as i32, o.op as i32, stream);
            for _ in 0..o.warmup {
                ncall()?;
            }
            sync()?;
            comm.bootstrap.barrier()?;
            let t = events.median_us(stream, ncall)?;
            let all = comm.bootstrap.allgather(&t.to_le_bytes())?;
            row.nccl_us = Some(all.iter().map(|b| f64::from_le_bytes(b[..8].try_into().unwrap())).fold(0.0, f64::max));
        }
        if row.wrong.iter().any(|&w| w > 0) {
            all_ok = false;
        }
        if rank == 0 {
            let gbs = |us: f64| size as f64 / us / 1e3;
            let ratio = if row.copy_us > 0.0 { row.copy_us / row.times[0] } else { 0.0 };
            let nccl_cols = match row.nccl_us {
                Some(t) => format!("{:>10.1} {:>8.1} {:>7.3}", t, gbs(t) * factor, t / row.times[0]),
                None => format!("{:>10} {:>8} {:>7}", "-", "-", "-"),
            };
            println!("  {:>12} {:>12} {:>6}   {:>10.1} {:>8.1} {:>8.1} {:>6}   {:>10.1} {:>8.1} {:>8.1} {:>6}   {:>10.1} {:>8.1} {:>7.3}   {nccl_cols}",
                size, count, "float", row.times[0], gbs(row.times[0]), gbs(row.times[0]) * factor, row.wrong[0],
                row.times[1], gbs(row.times[1]), gbs(row.times[1]) * factor, row.wrong[1],
                row.copy_us, 2.0 * gbs(row.copy_us), ratio);
        }
        rows.push(row);
        bytes *= o.factor;
    }
    if rank == 0 {
        println!("# algbw, busbw in GB/s (1e9 B/s); D2D GB/s counts bytes read + written; oop/copy = copy time / out-of-place time; bw/nccl = NCCL time / our out-of-place time");
        use crate::record::{self, Json};
        record::config("ranks", Json::num(n as f64));
        record::config("dtype", Json::str("float32"));
        record::config("op", Json::str(format!("{:?}", o.op)));
        record::config("bus_factor", Json::num(factor));
        for r in &rows {
            let named = record::contender_median;
            let out_of_place = Json::obj(&[
                ("name", Json::str("out_of_place")),
                ("median_us", Json::num(r.times[0])),
                ("host_enqueue_us", Json::num(r.host_us)),
            ]);
            let mut contenders = vec![out_of_place, named("in_place", r.times[1])];
            if r.copy_us > 0.0 {
                contenders.push(named("d2d_copy", r.copy_us));
            }
            if let Some(t) = r.nccl_us {
                contenders.push(named("nccl", t));
            }
            record::row(
                Json::obj(&[
                    ("op", Json::str(kind.name())),
                    ("bytes", Json::num(r.bytes as f64)),
                    ("count", Json::num(r.count as f64)),
                ]),
                contenders,
                &[("wrong", Json::Arr(vec![Json::num(r.wrong[0] as f64), Json::num(r.wrong[1] as f64)]))],
            );
        }
    }
    comm.bootstrap.barrier()?;
    drop(nccl);
    drop(comm);
    Ok(all_ok)
}
