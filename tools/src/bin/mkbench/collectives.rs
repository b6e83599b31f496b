//! `mkbench all_gather | reduce_scatter | all_reduce`, in the style of nccl-tests:
//!
//!   mkbench all_reduce -b 8 -e 1G -f 2 -n 20 -w 5 --blocks 5 -g <ranks> [--threads]
//!                      [--op sum|prod|max|min|avg] [--dtype float|half|bfloat16|...|all] [--json PATH]
//!
//! With -g N > 1 it starts N rank processes of itself (sharing the GPU under MPS, or one
//! per GPU), or joins ranks a launcher started (MK_TEST_RANK / MK_TEST_NRANKS /
//! MK_TEST_ID_FILE, as mktest). `--threads` runs the N ranks as threads of this process
//! instead, every communicator on device 0 (as `mkCommInitAll` with a repeated device): one
//! context, no MPS, so the ranks' calls start without the skew between processes, which
//! reaches tens of µs under MPS and would dominate small-message latency. Sizes are bytes of the larger buffer (nccl-tests'
//! convention: AllGather's recvbuff, ReduceScatter's sendbuff, AllReduce's buffer), from -b
//! to -e by -f; a size too small for one element per rank segment runs one element (the
//! table shows the size run), and a size whose count repeats the previous one is left out.
//! `--dtype` takes a comma-separated list of the library's types (int8 uint8 int32 uint32
//! int64 uint64 half float double bfloat16, or fp16 fp32 fp64 bf16) or `all`; float by
//! default.
//!
//! Per dtype and size, first the check: out of place, then in place, one call each on
//! fresh inputs with the output poisoned, every output element compared on the host with
//! its expected value (collective_check.rs); #wrong is the count outside the bound, summed
//! over the ranks. Then the shared protocol (measure.rs: -w warm-up calls, --blocks
//! interleaved blocks of -n calls, the slowest rank per call; median, p10, p90, and the
//! host's enqueue time per call) over: out of place; in place (its input restored before
//! each call and the stream idle again, outside the timing, so values never grow and the
//! call starts as an out-of-place one does); a device-to-device cuMemcpyAsync
//! of the same size on rank 0 while the other ranks wait (read + write, as our one-rank
//! copy); NCCL (dlopen, nccl.rs) out of place on the same buffers when the ranks sit on
//! several GPUs (NCCL refuses two ranks on one GPU); and CUDA-graph replays of
//! GRAPH_CALLS captured out-of-place calls, ours and NCCL's (time per call).
//! algbw = size / time; busbw = algbw × (n−1)/n (AllGather, ReduceScatter) or × 2(n−1)/n
//! (AllReduce).

use crate::collective_check::{Expectation, PERIOD};
use crate::fused_common::{capture_everywhere, measure_slowest, run_ranks, Timed};
use crate::measure::{Measured, Progress, Protocol, GRAPH_CALLS};
use crate::nccl::Nccl;
use crate::record::{self, Json};
use crate::timing::Events;

use cudarc::driver::result as cu;
use mkernel::comm::CommConfig;
use mkernel::cuda::{self, PrimaryContext};
use mkernel::error::{MkError, Result};
use mkernel::ops::collectives::{collective, CollectiveKind};
use mkernel::types::{mkDataType_t, mkRedOp_t, Element};
use mkernel_tools::testing::fill::fill_random;
use mkernel_tools::testing::TestBuffer;

struct Options {
    kind: CollectiveKind,
    min_bytes: u64,
    max_bytes: u64,
    factor: u64,
    iters: usize,
    warmup: usize,
    blocks: usize,
    ranks: usize,
    /// The ranks as threads of this process on device 0, instead of rank processes.
    threads: bool,
    op: mkRedOp_t,
    dtypes: Vec<mkDataType_t>,
}

/// The names `--dtype` takes: the library's own (as mkDataType_t::name) and the short ones.
const DTYPE_NAMES: &[(&str, mkDataType_t)] = &[
    ("int8", mkDataType_t::mkInt8),
    ("uint8", mkDataType_t::mkUint8),
    ("int32", mkDataType_t::mkInt32),
    ("uint32", mkDataType_t::mkUint32),
    ("int64", mkDataType_t::mkInt64),
    ("uint64", mkDataType_t::mkUint64),
    ("half", mkDataType_t::mkFloat16),
    ("fp16", mkDataType_t::mkFloat16),
    ("float", mkDataType_t::mkFloat32),
    ("fp32", mkDataType_t::mkFloat32),
    ("double", mkDataType_t::mkFloat64),
    ("fp64", mkDataType_t::mkFloat64),
    ("bfloat16", mkDataType_t::mkBfloat16),
    ("bf16", mkDataType_t::mkBfloat16),
    ("float8e4m3", mkDataType_t::mkFloat8e4m3),
    ("float8e5m2", mkDataType_t::mkFloat8e5m2),
];

fn parse_dtypes(v: &str) -> Option<Vec<mkDataType_t>> {
    if v == "all" {
        return Some(mkDataType_t::ALL.to_vec());
    }
    let mut out: Vec<mkDataType_t> = Vec::new();
    for name in v.split(',') {
        let t = DTYPE_NAMES.iter().find(|(n, _)| *n == name.trim())?.1;
        if !out.contains(&t) {
            out.push(t);
        }
    }
    (!out.is_empty()).then_some(out)
}

fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1u64 << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().ok().and_then(|v| v.checked_mul(mul))
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
        iters: Protocol::DEFAULT.iters,
        warmup: Protocol::DEFAULT.warmup,
        blocks: Protocol::DEFAULT.blocks,
        ranks: 1,
        threads: false,
        op: mkRedOp_t::mkSum,
        dtypes: vec![mkDataType_t::mkFloat32],
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--threads" {
            o.threads = true;
            continue;
        }
        let mut val = || it.next().cloned().ok_or_else(|| MkError::invalid_argument(format!("{a} needs a value")));
        let bad = |a: &str| MkError::invalid_argument(format!("bad value for {a}"));
        match a.as_str() {
            "-b" => o.min_bytes = parse_size(&val()?).ok_or_else(|| bad("-b"))?,
            "-e" => o.max_bytes = parse_size(&val()?).ok_or_else(|| bad("-e"))?,
            "-f" => o.factor = val()?.parse().map_err(|_| bad("-f"))?,
            "-n" => o.iters = val()?.parse().map_err(|_| bad("-n"))?,
            "-w" => o.warmup = val()?.parse().map_err(|_| bad("-w"))?,
            "--blocks" => o.blocks = val()?.parse().map_err(|_| bad("--blocks"))?,
            "-g" => o.ranks = val()?.parse().map_err(|_| bad("-g"))?,
            "--op" => {
                o.op = match val()?.as_str() {
                    "sum" => mkRedOp_t::mkSum,
                    "prod" => mkRedOp_t::mkProd,
                    "max" => mkRedOp_t::mkMax,
                    "min" => mkRedOp_t::mkMin,
                    "avg" => mkRedOp_t::mkAvg,
                    _ => return Err(bad("--op (sum, prod, max, min or avg)")),
                }
            }
            "--dtype" => {
                o.dtypes = parse_dtypes(&val()?).ok_or_else(|| {
                    bad("--dtype (int8 uint8 int32 uint32 int64 uint64 half float double bfloat16 float8e4m3 float8e5m2, comma-separated, or all)")
                })?;
                // A reduction's "all" is every type it reduces (the type table says which).
                if kind != CollectiveKind::AllGather {
                    o.dtypes.retain(|t| t.element().accepted.reduce);
                    if o.dtypes.is_empty() {
                        return Err(bad("--dtype: none of these types is reduced by mkReduceScatter and mkAllReduce"));
                    }
                }
            }
            other => {
                return Err(MkError::invalid_argument(format!(
                    "unknown option {other:?} (see src/bin/mkbench/collectives.rs)"
                )))
            }
        }
    }
    if o.factor < 2 || o.ranks == 0 || o.min_bytes == 0 || o.min_bytes > o.max_bytes {
        return Err(MkError::invalid_argument("need -f >= 2, -g >= 1 and 0 < -b <= -e"));
    }
    Protocol { warmup: o.warmup, blocks: o.blocks, iters: o.iters }.validate()?;
    Ok(o)
}

/// The sizes of a sweep from `min` to `max` bytes by `factor`: (bytes run, elements per
/// rank segment). A size too small for one element per segment runs one; a size whose
/// count repeats the previous one is left out.
pub(crate) fn sweep(kind: CollectiveKind, min: u64, max: u64, factor: u64, es: u64, nranks: u64) -> Vec<(u64, u64)> {
    let per_count = if kind == CollectiveKind::AllReduce { es } else { es * nranks };
    let mut sizes: Vec<(u64, u64)> = Vec::new();
    let mut bytes = min;
    while bytes <= max {
        let count = (bytes / per_count).max(1);
        if sizes.last().is_none_or(|&(_, c)| c != count) {
            sizes.push((count * per_count, count));
        }
        match bytes.checked_mul(factor) {
            Some(b) => bytes = b,
            None => break,
        }
    }
    sizes
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
    run_ranks(op_name, args, o.ranks, o.threads, &|rank, n, id, device| rank_main(&o, rank, n, id, device))
}

/// Bytes of output downloaded at a time for the host check (a multiple of every type's size).
const CHECK_CHUNK: usize = 16 << 20;

/// Wrong elements among the `elements` output elements at `out` (`count` per rank segment).
fn wrong_elements(expect: &Expectation, es: usize, out: u64, elements: u64, count: u64) -> Result<u64> {
    let total = elements as usize * es;
    let mut host = vec![0u8; total.min(CHECK_CHUNK)];
    let mut wrong = 0;
    let mut at = 0;
    while at < total {
        let len = (total - at).min(CHECK_CHUNK);
        // SAFETY: the caller's buffer holds `elements` elements at `out`.
        unsafe { cu::memcpy_dtoh_sync(&mut host[..len], out + at as u64) }
            .map_err(|e| cuda::cuda_err("cuMemcpyDtoH", e))?;
        wrong += expect.wrong(count, (at / es) as u64, &host[..len]);
        at += len;
    }
    Ok(wrong)
}

fn rank_main(o: &Options, rank: usize, n: usize, id: &mkernel::bootstrap::UniqueId, device: i32) -> Result<bool> {
    let ctx = PrimaryContext::retain(device)?;
    let _g = ctx.enter()?;
    let comm = crate::fused_common::init_comm(id, n, rank, device, CommConfig::from_env())?;
    let stream =
        cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| cuda::cuda_err("cuStreamCreate", e))?;
    let nr = n as u64;
    let kind = o.kind;
    let sweeps: Vec<(mkDataType_t, Vec<(u64, u64)>)> =
        o.dtypes.iter().map(|&d| (d, sweep(kind, o.min_bytes, o.max_bytes, o.factor, d.size() as u64, nr))).collect();
    // Buffers for the largest case of any dtype, in bytes.
    let (mut send_bytes, mut recv_bytes, mut size_max) = (1u64, 1u64, 1u64);
    for (d, sizes) in &sweeps {
        for &(size, count) in sizes {
            let (s, r) = kind.buffer_counts(count, nr).expect("counts fit in u64");
            send_bytes = send_bytes.max(s * d.size() as u64);
            recv_bytes = recv_bytes.max(r * d.size() as u64);
            size_max = size_max.max(size);
        }
    }
    let bytes_buffer = |b: u64| TestBuffer::new(b as usize, mkDataType_t::mkUint8);
    // `inputs` keeps this rank's input; `send` and `recv` are the calls' buffers (in place,
    // ReduceScatter works in `send`, the others in `recv`).
    let inputs = bytes_buffer(send_bytes)?;
    let send = bytes_buffer(send_bytes)?;
    let recv = bytes_buffer(recv_bytes)?;
    let copy_buffers = if rank == 0 { Some((bytes_buffer(size_max)?, bytes_buffer(size_max)?)) } else { None };
    if let Some((src, _)) = &copy_buffers {
        fill_random(src.ptr(), size_max / 4, mkDataType_t::mkFloat32, 7, 1.0, stream)?;
    }
    let events = Events::new(o.iters)?;
    let protocol = Protocol { warmup: o.warmup, blocks: o.blocks, iters: o.iters };
    let sync = || -> Result<()> {
        // SAFETY: live stream.
        unsafe { cu::stream::synchronize(stream) }.map_err(|e| cuda::cuda_err("cuStreamSynchronize", e))
    };
    let async_error = |what: &str| -> Result<()> {
        let err = comm.async_error();
        if err != mkernel::mkResult_t::mkSuccess {
            return Err(MkError::new(err, format!("{} failed asynchronously: {what}", kind.name())));
        }
        Ok(())
    };
    // The inputs' seed, fresh per run, the same on every rank.
    let mine = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
    let seed_bytes = comm.bootstrap.broadcast(&mine.to_le_bytes(), 0)?;
    let seed = u64::from_le_bytes(seed_bytes[..8].try_into().expect("8 bytes"));
    let node_size = if comm.topology.spans_nodes() { comm.topology.local_size() } else { n };

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
    let factor = match kind {
        CollectiveKind::AllReduce => 2.0 * (nr as f64 - 1.0) / nr as f64,
        _ => (nr as f64 - 1.0) / nr as f64,
    };
    let op_arg = (kind != CollectiveKind::AllGather).then_some(o.op as i32);
    let redop = if kind == CollectiveKind::AllGather { "none".to_string() } else { format!("{:?}", o.op) };
    let mut progress = (rank == 0).then(|| Progress::new(sweeps.iter().map(|s| s.1.len()).sum()));
    if rank == 0 {
        let sms = cuda::sm_count(device)?;
        println!(
            "# mkbench {}: {n} rank(s){}, {}, op {redop}, {sms} SMs, MK_MAX_CTAS={}, warm-up {} then {} interleaved blocks of {} calls (median of the slowest rank per call); graphs of {GRAPH_CALLS} calls",
            kind.name(),
            if o.threads { " as threads of one process" } else { "" },
            o.dtypes.iter().map(|d| d.name()).collect::<Vec<_>>().join(","),
            comm.config.max_ctas.map_or("-".into(), |v| v.to_string()),
            o.warmup,
            o.blocks,
            o.iters
        );
        println!("# NCCL baseline: {nccl_note}");
        println!("# check: every output element on the host against its expected value (collective_check.rs), once per size, out of place and in place");
        if comm.topology.spans_nodes() {
            let net = comm.inter_node.lock().as_ref().map(|i| format!("{:?}", i.net)).unwrap_or_default();
            println!("# across {} nodes of {} ranks (hierarchical kernel), inter-node over {net}: network GB/s per rank = algbw x {:.3}",
                comm.topology.node_count, comm.topology.local_size(),
                mkernel::ops::collectives::hier::network_fraction(kind, comm.topology.node_count as u64, nr));
        }
        println!("#");
        println!(
            "# {:>11} {:>11} {:>8}   {:>9} {:>7} {:>7} {:>6}   {:>9} {:>7} {:>6}   {:>9} {:>7}   {:>7}   {:>9} {:>7}   {:>9} {:>7} {:>9}",
            "size(B)", "count", "type", "oop(us)", "algbw", "busbw", "#wrong", "ip(us)", "busbw", "#wrong",
            "graph(us)", "busbw", "host", "copy(us)", "GB/s", "nccl(us)", "busbw", "graph(us)"
        );
    }
    let mut all_ok = true;
    for (dtype, sizes) in &sweeps {
        let dtype = *dtype;
        let es = dtype.size() as u64;
        let expect = Expectation::new(
            kind,
            dtype,
            o.op,
            seed ^ (dtype as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            rank,
            n,
            node_size,
            PERIOD,
        );
        let max_send = sizes.iter().map(|&(_, c)| kind.buffer_counts(c, nr).expect("fits").0).max().unwrap_or(0);
        let input = expect.input(max_send);
        // SAFETY: `inputs` holds send_bytes >= max_send elements of this dtype.
        unsafe { cu::memcpy_htod_sync(inputs.ptr(), &input) }.map_err(|e| cuda::cuda_err("cuMemcpyHtoD", e))?;
        drop(input);
        // NCCL in this dtype and op: a first call every rank makes (argument errors show on
        // the host, the same on every rank).
        let nccl_here = match &nccl {
            Some(nc) => {
                let ok = nc.call(kind as i32, send.ptr(), recv.ptr(), 1, dtype as i32, o.op as i32, stream).is_ok();
                sync()?;
                comm.bootstrap.allgather(&[u8::from(ok)])?.iter().all(|v| v.first() == Some(&1))
            }
            None => false,
        };
        for &(size, count) in sizes {
            if let Some(p) = progress.as_mut() {
                p.step(&format!("{} {} B", dtype.name(), size));
            }
            let (send_n, recv_n) = kind.buffer_counts(count, nr).expect("fits");
            let seg = count * es;
            let (ip_send, ip_recv) = match kind {
                CollectiveKind::AllGather => (recv.ptr() + rank as u64 * seg, recv.ptr()),
                CollectiveKind::ReduceScatter => (send.ptr(), send.ptr() + rank as u64 * seg),
                CollectiveKind::AllReduce => (recv.ptr(), recv.ptr()),
            };
            let out_elements = if kind == CollectiveKind::AllGather { recv_n } else { count };
            let restore = |dst: u64| -> Result<()> {
                // SAFETY: `inputs` and dst (send, or recv's in-place input) hold send_n elements.
                unsafe { cu::memcpy_dtod_async(dst, inputs.ptr(), (send_n * es) as usize, stream) }
                    .map_err(|e| cuda::cuda_err("cuMemcpyDtoDAsync", e))
            };
            let call = |s: u64, r: u64| collective(&comm, kind, s, r, count as usize, dtype as i32, op_arg, stream);
            let out_of_place = || call(send.ptr(), recv.ptr());
            let in_place = || call(ip_send, ip_recv);
            // The restoring copy finishes before the timed call is enqueued: left in flight,
            // the GPU runs it while the host enqueues the call, and a host-bound small call
            // reads 2-3 µs faster in place than out of place.
            let restore_in_place = || restore(ip_send).and_then(|_| sync());

            // The check, out of place then in place, before any timing.
            restore(send.ptr())?;
            recv.poison(stream)?;
            comm.bootstrap.barrier()?;
            out_of_place()?;
            sync()?;
            async_error(&format!("{} B out of place", size))?;
            let wrong_oop = wrong_elements(&expect, es as usize, recv.ptr(), out_elements, count)?;
            if kind == CollectiveKind::AllGather {
                recv.poison(stream)?;
            }
            restore_in_place()?;
            comm.bootstrap.barrier()?;
            in_place()?;
            sync()?;
            async_error(&format!("{} B in place", size))?;
            let wrong_ip = wrong_elements(&expect, es as usize, ip_recv, out_elements, count)?;
            let wrong_all = comm.bootstrap.allgather(&[wrong_oop.to_le_bytes(), wrong_ip.to_le_bytes()].concat())?;
            let word = |b: &Vec<u8>, i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"));
            let wrong = [0, 1].map(|i| wrong_all.iter().map(|b| word(b, i)).sum::<u64>());
            all_ok &= wrong == [0, 0];
            restore(send.ptr())?;

            let copy = || match &copy_buffers {
                // SAFETY: both hold size_max >= size bytes.
                Some((src, dst)) => unsafe { cu::memcpy_dtod_async(dst.ptr(), src.ptr(), size as usize, stream) }
                    .map_err(|e| cuda::cuda_err("cuMemcpyDtoDAsync", e)),
                None => Ok(()),
            };
            let nccl_call = || match &nccl {
                Some(nc) => {
                    nc.call(kind as i32, send.ptr(), recv.ptr(), count as usize, dtype as i32, o.op as i32, stream)
                }
                None => Ok(()),
            };
            let graph_of_ours = capture_everywhere(&comm, stream, GRAPH_CALLS, &[&out_of_place])?;
            let graph_of_nccl = if nccl_here {
                capture_everywhere(&comm, stream, GRAPH_CALLS, &[&nccl_call])?
            } else {
                Err("no NCCL here".into())
            };
            let mut names = vec!["out_of_place", "in_place", "d2d_copy"];
            let mut contenders =
                vec![Timed::Calls(&out_of_place), Timed::CallsAfter(&in_place, &restore_in_place), Timed::Calls(&copy)];
            if nccl_here {
                names.push("nccl");
                contenders.push(Timed::Calls(&nccl_call));
            }
            if let Ok(g) = &graph_of_ours {
                names.push("out_of_place_graph");
                contenders.push(Timed::Graph(&g[0]));
            }
            if let Ok(g) = &graph_of_nccl {
                names.push("nccl_graph");
                contenders.push(Timed::Graph(&g[0]));
            }
            let m = measure_slowest(&comm, &events, stream, protocol, &contenders)?;
            sync()?;
            async_error(&format!("{} B, timed calls", size))?;
            if rank == 0 {
                if let Err(why) = &graph_of_ours {
                    println!("# {} B: no graph replay of ours ({why})", size);
                }
                if let (true, Err(why)) = (nccl_here, &graph_of_nccl) {
                    println!("# {} B: no graph replay of NCCL ({why})", size);
                }
                print_row(dtype, size, count, factor, &names, &m, wrong);
                let mut shape = vec![
                    ("op", Json::str(kind.name())),
                    ("dtype", Json::str(dtype.name())),
                    ("bytes", Json::num(size as f64)),
                    ("count", Json::num(count as f64)),
                ];
                if kind != CollectiveKind::AllGather {
                    shape.push(("redop", Json::str(&redop)));
                }
                record::row(
                    Json::obj(&shape),
                    record::measured_contenders(&names, &m),
                    &[("wrong", Json::Arr(vec![Json::num(wrong[0] as f64), Json::num(wrong[1] as f64)]))],
                );
            }
            drop(graph_of_ours);
            drop(graph_of_nccl);
        }
    }
    if rank == 0 {
        println!("# algbw, busbw in GB/s (1e9 B/s); copy GB/s counts bytes read + written; host: µs to enqueue one out-of-place call; graph: per call, replays of {GRAPH_CALLS} captured calls");
        record::config("ranks", Json::num(n as f64));
        record::config("dtypes", Json::Arr(o.dtypes.iter().map(|d| Json::str(d.name())).collect()));
        record::config("op", Json::str(&redop));
        record::config("bus_factor", Json::num(factor));
        record::config(
            "protocol",
            Json::obj(&[
                ("warmup", Json::num(o.warmup as f64)),
                ("blocks", Json::num(o.blocks as f64)),
                ("iters", Json::num(o.iters as f64)),
                ("graph_calls", Json::num(GRAPH_CALLS as f64)),
            ]),
        );
        record::config("nccl", Json::str(&nccl_note));
        record::config("check", Json::str("every output element on the host, out of place and in place"));
    }
    comm.bootstrap.barrier()?;
    drop(nccl);
    drop(comm);
    // SAFETY: no work pending after the last synchronisation.
    let _ = unsafe { cu::stream::destroy(stream) };
    Ok(all_ok)
}

/// One row of the table (rank 0), from the measured contenders by name.
fn print_row(dtype: mkDataType_t, size: u64, count: u64, factor: f64, names: &[&str], m: &Measured, wrong: [u64; 2]) {
    let med = |name: &str| names.iter().position(|n| *n == name).map(|i| m.median(i));
    let gbs = |us: f64| size as f64 / us / 1e3;
    let time = |t: Option<f64>| t.map_or(format!("{:>9}", "-"), |t| format!("{t:>9.1}"));
    let bus = |t: Option<f64>| t.map_or(format!("{:>7}", "-"), |t| format!("{:>7.1}", gbs(t) * factor));
    let oop = med("out_of_place").unwrap_or(f64::NAN);
    let ip = med("in_place");
    let graph = med("out_of_place_graph");
    let copy = med("d2d_copy");
    let nccl = med("nccl");
    let nccl_graph = med("nccl_graph");
    let host = names.iter().position(|n| *n == "out_of_place").map_or(f64::NAN, |i| m.host_us[i]);
    let copy_gbs = copy.map_or(format!("{:>7}", "-"), |t| format!("{:>7.1}", 2.0 * gbs(t)));
    println!(
        "  {:>11} {:>11} {:>8}   {:>9.1} {:>7.1} {:>7.1} {:>6}   {} {} {:>6}   {} {}   {:>7.1}   {} {}   {} {} {}",
        size,
        count,
        dtype.name(),
        oop,
        gbs(oop),
        gbs(oop) * factor,
        wrong[0],
        time(ip),
        bus(ip),
        wrong[1],
        time(graph),
        bus(graph),
        host,
        time(copy),
        copy_gbs,
        time(nccl),
        bus(nccl),
        time(nccl_graph)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn dtypes_parse_by_name_alias_list_or_all() {
        let o = parse("all_reduce", &args("--dtype bf16,float,half,fp32")).unwrap();
        assert_eq!(o.dtypes, [mkDataType_t::mkBfloat16, mkDataType_t::mkFloat32, mkDataType_t::mkFloat16]);
        let reducing: Vec<_> = mkDataType_t::ALL.into_iter().filter(|t| t.element().accepted.reduce).collect();
        assert_eq!(parse("all_reduce", &args("--dtype all")).unwrap().dtypes, reducing);
        assert_eq!(parse("all_gather", &args("--dtype all")).unwrap().dtypes, mkDataType_t::ALL);
        assert_eq!(parse("all_reduce", &args("--dtype float8e4m3")).unwrap().dtypes, [mkDataType_t::mkFloat8e4m3]);
        assert_eq!(parse("all_gather", &[]).unwrap().dtypes, [mkDataType_t::mkFloat32]);
        for t in mkDataType_t::ALL {
            assert_eq!(parse_dtypes(t.name()), Some(vec![t]), "{}", t.name());
        }
        assert!(parse("all_reduce", &args("--dtype float,fp8")).is_err(), "fp8 is no name: float8e4m3 or float8e5m2");
        assert!(parse("all_reduce", &args("--dtype")).is_err());
        assert!(parse("all_reduce", &args("--op prod")).is_ok());
        assert!(parse("all_reduce", &args("--op xor")).is_err());
        assert!(parse("all_reduce", &args("--blocks 0")).is_err());
        assert!(parse("all_reduce", &args("-b 1K -e 8")).is_err());
    }

    #[test]
    fn threads_is_a_lone_flag_anywhere() {
        assert!(!parse("all_reduce", &args("-g 2")).unwrap().threads);
        let o = parse("all_reduce", &args("--threads -g 2 -e 64K")).unwrap();
        assert!(o.threads && o.ranks == 2 && o.max_bytes == 64 << 10);
        assert!(parse("all_reduce", &args("-g 2 --threads")).unwrap().threads);
        // It takes no value: what follows is the next option.
        assert!(parse("all_reduce", &args("--threads 2")).is_err());
    }

    #[test]
    fn a_sweep_starts_at_one_element_and_never_repeats_a_count() {
        let ag = CollectiveKind::AllGather;
        let ar = CollectiveKind::AllReduce;
        // 8 B of double over 8 ranks: one element per rank, 64 B run.
        assert_eq!(sweep(ag, 8, 64, 2, 8, 8), [(64, 1)]);
        assert_eq!(sweep(ag, 8, 256, 2, 8, 8), [(64, 1), (128, 2), (256, 4)]);
        // AllReduce counts the whole buffer: 8 B of float is 2 elements.
        assert_eq!(sweep(ar, 8, 32, 2, 4, 8), [(8, 2), (16, 4), (32, 8)]);
        assert_eq!(sweep(ar, 1, 4, 2, 1, 1), [(1, 1), (2, 2), (4, 4)]);
        // The nccl-tests sweep up to 1 GiB: 28 sizes of float for one rank, the last 1 GiB.
        let s = sweep(ar, 8, 1 << 30, 2, 4, 1);
        assert_eq!(s.len(), 28);
        assert_eq!(s.last(), Some(&(1 << 30, 1 << 28)));
        // A factor that would overflow stops the sweep instead.
        assert_eq!(sweep(ar, 1 << 62, u64::MAX, 4, 1, 1).len(), 1);
        assert!(parse_size("16E").is_none() && parse_size("17179869184G").is_none());
        assert_eq!(parse_size("1G"), Some(1 << 30));
    }
}
